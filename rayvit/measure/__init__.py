"""Runtime probes, on an initialised process group: collective timings (:mod:`~rayvit.measure.timers`),
the links microbenchmark a sweep runs on its workers (:mod:`~rayvit.measure.links`) and each strategy's
own host path per collective (:mod:`~rayvit.measure.paths`). What they measure feeds the analytic
projection (:mod:`rayvit.projection`), which itself measures nothing."""
