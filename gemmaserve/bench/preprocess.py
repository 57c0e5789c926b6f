"""What preparing one image or one 30 s clip for its encoder costs the host, ours against transformers' processors
in the same run, outputs checked equal (`taskset -c 0 gemmaserve bench preprocess`: one core).

    Gemma 4 image  (decoded PIL image -> patches + positions, 280 and 1120 soft tokens)  vs Gemma4ImageProcessorPil
    Gemma 3 image  (decoded PIL image -> 896 x 896 normalised pixels)                     vs Gemma3ImageProcessorPil
    audio          (30 s of 16 kHz samples -> 128-bin log-mel features and frame mask)    vs Gemma4AudioFeatureExtractor

Images are photographs' sizes (640 x 480 to 4000 x 3000) of random content, decoded before timing (decoding
is the same library call for both). `resize_ms` is Pillow's resize alone, the call both make (the part of an
image's time that equality with transformers leaves as it is). Each figure is the median of `--repeat` runs. Writes
$OUT/preprocess.json (or bench-out/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

SIZES = ((640, 480), (1024, 768), (1920, 1080), (4000, 3000))


def _median_ms(fn, repeat: int) -> float:
    fn()   # warm: imports, caches
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _images(seed: int, sizes: tuple[tuple[int, int], ...] = SIZES):
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for w, h in sizes:   # smooth content (a photograph compresses and resizes like this, unlike noise)
        base = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        out.append(Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR))
    return out


def gemma4_images(repeat: int, sizes: tuple[tuple[int, int], ...] = SIZES) -> list[dict]:
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from ..models.gemma4_vision import Gemma4ImageProcessor

    rows = []
    for soft in (280, 1120):
        ours, ref = Gemma4ImageProcessor(16, 3, soft), Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=soft,
                                                                               pooling_kernel_size=3)
        for image in _images(soft, sizes):
            got, want = ours(image), ref([image], return_tensors="np")
            err = float(np.abs(got.data - want["pixel_values"][0]).max())
            same_pos = bool(np.array_equal(got.extra, want["image_position_ids"][0]))
            th, tw = ours.target_size(image.height, image.width)
            rows.append({"what": f"gemma4 image {image.width}x{image.height} -> {soft} tokens",
                         "ours_ms": _median_ms(lambda: ours(image), repeat),
                         "resize_ms": _median_ms(lambda: image.resize((tw, th), Image.Resampling.BICUBIC), repeat),
                         "transformers_ms": _median_ms(lambda: ref([image], return_tensors="np"), repeat),
                         "max_abs_diff": err, "positions_equal": same_pos})
    return rows


def gemma3_images(repeat: int, sizes: tuple[tuple[int, int], ...] = SIZES) -> list[dict]:
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from ..models.image_processing import ImageProcessor

    ours = ImageProcessor(896, 256)
    ref = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    rows = []
    for image in _images(3, sizes):
        err = float(np.abs(ours(image).data - ref([image], return_tensors="np")["pixel_values"][0]).max())
        rows.append({"what": f"gemma3 image {image.width}x{image.height} -> 896x896",
                     "ours_ms": _median_ms(lambda: ours(image), repeat),
                     "resize_ms": _median_ms(lambda: image.resize((896, 896), Image.Resampling.BILINEAR), repeat),
                     "transformers_ms": _median_ms(lambda: ref([image], return_tensors="np"), repeat),
                     "max_abs_diff": err})
    return rows


def audio(repeat: int) -> list[dict]:
    from transformers import Gemma4AudioFeatureExtractor

    from ..models.audio_features import AudioFeatureConfig
    from ..models.gemma4_audio import AudioProcessor

    speech = Path(__file__).resolve().parents[2] / "tests" / "data" / "speech_16k.wav"
    if speech.is_file():   # real speech where the checkout has it, repeated to 30 s
        import soundfile

        samples = np.resize(soundfile.read(speech, dtype="float32")[0], 30 * 16_000)
    else:
        samples = (0.1 * np.random.default_rng(0).standard_normal(30 * 16_000)).astype(np.float32)
    ours, ref = AudioProcessor(AudioFeatureConfig()), Gemma4AudioFeatureExtractor()
    got, want = ours(samples), ref([samples], return_tensors="np")
    t = len(got.extra)
    return [{"what": "audio 30 s -> log-mel", "ours_ms": _median_ms(lambda: ours(samples), repeat),
             "transformers_ms": _median_ms(lambda: ref([samples], return_tensors="np"), repeat),
             "max_abs_diff": float(np.abs(got.data - want["input_features"][0][:t]).max()),
             "mask_equal": bool(np.array_equal(got.extra, want["input_features_mask"][0][:t]))}]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeat", type=int, default=15, help="timed runs of each case (the median is reported)")
    ap.add_argument("--sizes", type=int, default=len(SIZES), choices=range(1, len(SIZES) + 1),
                    help=f"image sizes to run, smallest first (of {len(SIZES)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="preprocess")
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    sizes = SIZES[:args.sizes]
    rows = gemma4_images(args.repeat, sizes) + gemma3_images(args.repeat, sizes) + audio(args.repeat)
    for r in rows:
        for key in ("ours_ms", "transformers_ms", "resize_ms"):
            if key in r:
                r[key] = round(r[key], 2)
        r["ratio"] = round(r["ours_ms"] / r["transformers_ms"], 3)
        print(json.dumps(r), flush=True)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    out = Path(os.environ.get("OUT", "bench-out")) / "preprocess.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                               "cores": cores, "repeat": args.repeat, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
