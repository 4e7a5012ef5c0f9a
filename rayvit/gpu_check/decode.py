"""The GPU check's case for ``data.decode=gpu``: nvJPEG's crops against the CPU decoder's (see
:mod:`rayvit.gpu_check`)."""

from __future__ import annotations

from rayvit.errors import NotCheckable


def check_gpu_decode(device, images: int = 64, size: int = 224) -> str:
    """``data.decode=gpu``: the sample photographs' training crops decoded by nvJPEG (torchvision, batched)
    match the CPU decoder's crops of the same boxes (mean absolute difference under 3 levels of 255), and
    how fast each path runs here (GPU: the whole batch; CPU: one core)."""
    import tempfile
    import time

    import numpy as np
    import torch

    from rayvit.data.gpu_decode import decode_planned, plan_batch
    from rayvit.data.images import ImageTransform, resize_box, decode_scaled
    from rayvit.data.photos import make_photos

    try:
        import skimage  # noqa: F401 - the sample photographs
        import torchvision  # noqa: F401
    except ImportError as e:
        raise NotCheckable(f"needs torchvision (built for this torch) and scikit-image: {e}") from e
    with tempfile.TemporaryDirectory() as tmp:
        files = sorted(make_photos(tmp, per_class=max(1, images // 8)).rglob("*.jpg"))
        encoded = [f.read_bytes() for f in files]
    spec = ImageTransform(size=size, train=True)
    plan = plan_batch({"image": np.array(encoded, dtype=object), "label": np.zeros(len(encoded))}, "image", "label", spec)
    decode_planned(plan, size, device)                          # warm: nvJPEG's handles and buffers
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    gpu = decode_planned(plan, size, device)["image"]
    torch.cuda.synchronize(device)
    gpu_s = time.perf_counter() - start
    start = time.perf_counter()
    cpu = []
    for data, box, flip in zip(plan["jpeg"], plan["box"].tolist(), plan["flip"].tolist()):
        crop = resize_box(decode_scaled(data, 1), tuple(box), size)[0]
        cpu.append(crop.flip(-1) if flip else crop)
    cpu_s = time.perf_counter() - start
    diff = (gpu.cpu().float() - torch.stack(cpu).float()).abs().mean().item()
    text = (f"{len(encoded)} crops at {size} px: mean |GPU - CPU| {diff:.2f} levels; nvJPEG batch "
            f"{len(encoded) / gpu_s:.0f} img/s, one CPU core {len(encoded) / cpu_s:.0f} img/s (full decode)")
    if diff > 3.0:
        raise RuntimeError("GPU-decoded crops differ from the CPU's: " + text)
    return text
