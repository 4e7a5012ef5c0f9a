"""What a study records and shows: MLflow runs and their chart views, result tables and parquet, figures."""
