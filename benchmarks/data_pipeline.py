"""rayvit's input pipeline against a plain PIL + torchvision-transforms pipeline, and JPEG decoders, per core.

    python benchmarks/data_pipeline.py [--per-class 40] [--rounds 5] [--size 224] [--python PY] [--other-python PY]

Makes the sample photographs (rayvit.data.photos: 8 x per-class ImageNet-sized JPEGs, scikit-image
needed), then times on ONE thread, in alternating rounds, the same files and the same crop boxes:

- decoders alone, each to an RGB array at full size: Pillow, simplejpeg (and its fast-DCT/fast-upsample
  flags), and in ``--other-python`` (a venv with pillow-simd and PyTurboJPEG 1.x over Debian's
  libturbojpeg0, which cannot share a venv with Pillow) those two;
- the training transform (RandomResizedCrop(size) + RandomHorizontalFlip, batched) and the validation
  transform (Resize(size / 0.875) + CenterCrop(size)) as the plain pipeline does them: PIL decodes in
  full, crops and resizes (bilinear), ``ToTensor`` + ``Normalize`` in float, ``default_collate`` stacks.
  torchvision's transforms do not import beside this CPU torch build, so they are written out with the
  same semantics (PIL's ``crop().resize()`` as ``F.resized_crop`` does for PIL images; ``ToTensor`` as
  ``float() / 255`` of the HWC array permuted to CHW; ``Normalize`` as ``sub_(mean).div_(std)``);
- torchvision.io.decode_jpeg + transforms v2 on uint8 tensors, the best peer, in an ``--other-python`` that
  imports torchvision (``benchmarks/torchvision_cpu_venv.sh`` makes one: torchvision 0.28.0 beside the
  CPU torch 2.13.0);
- rayvit's (rayvit.data.images) with each CPU decoder (turbojpeg: the crop's region alone): uint8 batch out (what Ray Data's tasks hand a
  GPU worker, which normalises on the device), and with the normalisation a CPU worker then does.

Pipelines work in batches of 32 images (a training batch).

Prints a markdown table (median images/s per core over rounds, the rounds' range, ratio to the plain
pipeline and, per round, to torchvision's) and the CPU's name and flags, then the uint8 outputs' pixel
mean and standard deviation (the same transform gives the same statistics); ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


# -- the plain pipeline (torchvision's transforms' semantics on PIL images) --------------------------------

def plain_box(width, height, rng):
    """torchvision RandomResizedCrop.get_params with its defaults (the same procedure as rayvit's)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, side, side


def plain_train(data: bytes, size: int, rng) -> torch.Tensor:
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    x, y, w, h = plain_box(*img.size, rng)
    img = img.crop((x, y, x + w, y + h)).resize((size, size), Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return to_tensor_normalize(img)


def plain_val(data: bytes, size: int, rng) -> torch.Tensor:
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    short = math.floor(size / 0.875)
    w, h = img.size
    img = img.resize((short, int(short * h / w)) if w < h else (int(short * w / h), short), Image.Resampling.BILINEAR)
    left, top = int(round((img.size[0] - size) / 2)), int(round((img.size[1] - size) / 2))
    return to_tensor_normalize(img.crop((left, top, left + size, top + size)))


def to_tensor_normalize(img) -> torch.Tensor:
    t = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(img.size[1], img.size[0], 3)
    t = t.permute(2, 0, 1).contiguous().float().div(255)
    return t.sub_(MEAN).div_(STD)


# -- decoders alone ---------------------------------------------------------------------------------

def decoders() -> dict:
    from PIL import Image

    out = {"pillow" if "post" not in Image.__version__ else "pillow-simd":
           lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))}
    try:
        import simplejpeg

        out["simplejpeg"] = lambda d: simplejpeg.decode_jpeg(d)
        out["simplejpeg fastdct+fastupsample"] = lambda d: simplejpeg.decode_jpeg(d, fastdct=True, fastupsample=True)
    except ImportError:
        pass
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        tj = TurboJPEG()
        out["PyTurboJPEG"] = lambda d: tj.decode(d, pixel_format=TJPF_RGB)
    except (ImportError, OSError, RuntimeError):
        pass
    return out


BATCH = 32


def torchvision_variants(size: int) -> dict:
    """torchvision.io.decode_jpeg + transforms v2 on uint8 tensors (RandomResizedCrop(size, antialias) and
    RandomHorizontalFlip; Resize(size / 0.875) + CenterCrop(size)), stacked: the best peer, where this
    interpreter imports torchvision (benchmarks/torchvision_cpu_venv.sh makes one beside the CPU torch)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms import v2
    except (ImportError, RuntimeError, OSError):
        return {}
    train = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    val = v2.Compose([v2.Resize(int(size / 0.875), antialias=True), v2.CenterCrop(size)])

    def run(transform):
        def one_batch(chunk, seed, at):
            torch.manual_seed(seed * 100_003 + at)
            return torch.stack([transform(decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8),
                                                      mode=ImageReadMode.RGB)) for d in chunk])
        return batched(one_batch)

    return {"torchvision.io.decode_jpeg + v2, train, uint8": run(train),
            "torchvision.io.decode_jpeg + v2, val, uint8": run(val)}


def batched(one_batch):
    """function(images, seed) running ``one_batch(chunk, seed, offset)`` over batches of BATCH images."""
    return lambda images, seed: [one_batch(images[i:i + BATCH], seed, i) for i in range(0, len(images), BATCH)]


def variants(size: int, own: bool) -> dict:
    """name -> function(list of encoded images, seed) that processes them all (one thread, batches of 32)."""
    out = {f"decode: {name}": (lambda f: lambda images, seed: [f(d) for d in images])(f)
           for name, f in decoders().items()}
    from PIL import Image

    lib = "pillow-simd" if "post" in Image.__version__ else "PIL"
    # default_collate stacks each batch's float tensors.
    out[f"plain {lib} + transforms, train"] = batched(lambda chunk, seed, at: torch.stack(
        [plain_train(d, size, random.Random(seed * 100_003 + at + i)) for i, d in enumerate(chunk)]))
    out[f"plain {lib} + transforms, val"] = batched(lambda chunk, seed, at: torch.stack(
        [plain_val(d, size, random.Random(0)) for d in chunk]))
    out.update(torchvision_variants(size))
    if own:
        from rayvit.data import turbo
        from rayvit.data.batching import uint8_normaliser
        from rayvit.data.images import ImageTransform, transform_batch

        normalise = uint8_normaliser(torch.device("cpu"))
        for decoder in ("pil", "simplejpeg") + (("turbojpeg",) if turbo.available() else ()):
            for train in (True, False):
                spec = ImageTransform(size=size, train=train, decoder=decoder)
                run = (lambda spec: lambda chunk, seed, at: transform_batch(
                    chunk, spec, [random.Random(seed * 100_003 + at + i) for i in range(len(chunk))], str)[0])(spec)
                what = "train" if train else "val"
                out[f"rayvit {decoder}, {what}, uint8"] = batched(run)
                out[f"rayvit {decoder}, {what}, normalised"] = batched(
                    (lambda run: lambda chunk, seed, at: normalise(torch.from_numpy(run(chunk, seed, at))))(run))
    return out


def worker(images_path: str, size: int, seed: int, own: bool) -> dict:
    """One round of every variant this interpreter has, in a rotated order: name -> images/s."""
    torch.set_num_threads(1)
    images = json.loads(Path(images_path).read_text())
    images = [bytes.fromhex(h) for h in images]
    table = variants(size, own)
    names = list(table)
    names = names[seed % len(names):] + names[:seed % len(names)]
    for name in names[:2]:
        table[name](images[:4], seed)          # warm
    rates = {}
    for name in names:
        start = time.perf_counter()
        outputs = table[name](images, seed)
        rates[name] = len(images) / (time.perf_counter() - start)
        if name.endswith("uint8"):
            # The pixels' mean and standard deviation over every output: the same transform gives the same.
            pixels = torch.cat([torch.as_tensor(np.asarray(b)).reshape(-1).float() for b in outputs])
            rates[f"{name} | mean"], rates[f"{name} | std"] = pixels.mean().item(), pixels.std().item()
    return rates


# -- the driver -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--other-python", action="append",
                        help="an interpreter with pillow-simd, PyTurboJPEG or torchvision (and torch); repeatable")
    parser.add_argument("--python", help="the interpreter for rayvit's own variants (default: this one); one that "
                                         "imports torchvision too (benchmarks/torchvision_cpu_venv.sh) times the "
                                         "peer in the same process")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--worker", nargs=3, metavar=("IMAGES", "SEED", "OWN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.size, int(args.worker[1]), args.worker[2] == "1")))
        return
    from rayvit.worker.bench_data import cpu_description
    from rayvit.datasets import make_photos

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_photos(Path(tmp) / "photos", per_class=args.per_class)
        files = sorted(folder.rglob("*.jpg"))
        images_path = Path(tmp) / "images.json"
        images_path.write_text(json.dumps([f.read_bytes().hex() for f in files]))
        sizes = [f.stat().st_size for f in files]
        pythons = [(args.python or sys.executable, "1")] + [(other, "0") for other in args.other_python or ()]
        # rayvit's own variants may run in another interpreter (--python: one that also imports torchvision,
        # so that every variant of a round runs in one process, side by side): it finds rayvit here.
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH")]))}
        rates: dict[str, list[float]] = {}
        mine: set[str] = set()
        for r in range(args.rounds):
            for python, own in (pythons if r % 2 == 0 else pythons[::-1]):
                out = subprocess.run([python, __file__, "--size", str(args.size), "--worker", str(images_path), str(r), own],
                                     capture_output=True, text=True, check=True, env=env)
                for name, rate in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    if own == "1":
                        mine.add(name)
                    elif name in mine:
                        name = f"{name} ({python})"        # the same variant in another interpreter
                    rates.setdefault(name, []).append(rate)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print_table(rates, args, len(files), sizes, cpu_description())


def paired_ratio(a: list[float], b: list[float]) -> str:
    """Median of the per-round ratios a/b and their range (both measured in the same rounds)."""
    ratios = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def print_table(rates: dict, args, count: int, sizes: list[int], cpu: str) -> None:
    stats = {name: v for name, v in rates.items() if " | " in name}
    rates = {name: v for name, v in rates.items() if " | " not in name}
    bases = {(peer, what): rates.get(name) for what in ("train", "val") for peer, name in (
        ("PIL", f"plain PIL + transforms, {what}"), ("tv", f"torchvision.io.decode_jpeg + v2, {what}, uint8"))}
    lines = [f"{count} JPEGs (rayvit.data.photos, {statistics.median(sizes) / 1e3:.0f} kB median), {args.size} px, "
             f"one thread, {args.rounds} alternating rounds; CPU: {cpu}", "",
             "| variant | images/s per core (median) | rounds' range | vs plain PIL | vs torchvision.io + v2 (per-round ratios) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, values in rates.items():
        med = statistics.median(values)
        what = "train" if "train" in name else "val" if "val" in name else None
        pil, tv = bases.get(("PIL", what)), bases.get(("tv", what))
        lines.append(f"| {name} | {med:.0f} | {min(values):.0f}-{max(values):.0f} | "
                     f"{f'{med / statistics.median(pil):.2f}x' if pil else ''} | {paired_ratio(values, tv) if tv else ''} |")
    if stats:
        lines += ["", "| uint8 output | pixel mean (0-255) | pixel std |", "| --- | ---: | ---: |"]
        for name in [n for n in rates if f"{n} | mean" in stats]:
            lines.append(f"| {name} | {statistics.median(stats[name + ' | mean']):.2f} | "
                         f"{statistics.median(stats[name + ' | std']):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
