"""Videos of a request: from what users pass (encoded bytes, data URLs, file paths in the Python API, or frames
with their rate) to the frames the model sees and their time stamps, within the request's limits.

    bytes -> PyAV (FFmpeg: MP4, WebM, MKV, MOV, AVI, ...) -> the first video stream, its frame count and rate
          -> frames i * total // n for i < n = min(max_frames, total), as transformers samples them uniformly
          -> RGB frames [n, H, W, 3] uint8 and their times i / rate ("mm:ss" in the prompt)

Decoding is FFmpeg's through PyAV, never ours; a file it cannot read, one with no video stream or no frame, and
anything over the limits is a UserInputError naming the input (a 400 from the server).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import UserInputError
from .images import base64_bytes, data_url_bytes


@dataclass(frozen=True)
class VideoLimits:
    """Per request; the server's defaults protect it from oversized uploads."""

    max_videos: int = 2
    max_bytes: int = 64 * 2**20      # of one encoded video
    max_frames: int = 32             # frames sampled from one video (each is an image's worth of tokens)
    max_seconds: float = 3600.0      # of one video
    max_pixels: int = 8192 * 4320    # width x height of its frames


@dataclass(frozen=True)
class Video:
    frames: np.ndarray       # [n, H, W, 3] uint8 RGB, the sampled frames
    times: list[float]       # seconds from the start of each

    def stamps(self) -> list[str]:
        return [f"{int(t // 60):02d}:{int(t % 60):02d}" for t in self.times]


def sample_indices(total: int, max_frames: int) -> np.ndarray:
    """At most `max_frames` frame indices spread evenly over `total` (transformers' uniform sampling; a video with
    fewer frames gives all of them)."""
    n = min(max_frames, total)
    return np.arange(n, dtype=np.int64) * total // n


def decode_video_bytes(data: bytes, limits: VideoLimits, what: str = "video") -> Video:
    """Encoded video -> its sampled frames and times, or a UserInputError naming why not."""
    import av

    if len(data) > limits.max_bytes:
        raise UserInputError(f"{what} is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise UserInputError(f"{what} holds no video stream")
            stream = container.streams.video[0]
            if stream.width * stream.height > limits.max_pixels:
                raise UserInputError(f"{what} is {stream.width}x{stream.height} pixels; the limit is "
                                     f"{limits.max_pixels} pixels")
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            total = int(stream.frames or 0)
            if total <= 0:   # the container does not say: count them
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total and rate and total / rate > limits.max_seconds:
                raise UserInputError(f"{what} is {total / rate:.1f} s long; the limit is {limits.max_seconds:g} s")
            if total == 0:
                raise UserInputError(f"{what} holds no frames")
            wanted = sample_indices(total, limits.max_frames)
            frames, keep = [], set(wanted.tolist())
            for i, frame in enumerate(container.decode(stream)):
                if i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if i >= wanted[-1]:
                    break
    except UserInputError:
        raise
    except Exception as exc:   # FFmpeg refuses broken or unknown data with several error kinds
        why = getattr(exc, "strerror", None) or str(exc)   # FFmpeg's own reason, without its errno and file name
        raise UserInputError(f"{what} could not be decoded: {why}") from None
    if not frames:
        raise UserInputError(f"{what} holds no frames")
    if len(frames) < len(wanted):   # the stream had fewer frames than its header said: sample what it had
        wanted = wanted[:len(frames)]
    return Video(np.stack(frames), [float(i) / (rate or 24.0) for i in wanted])


def frames_video(frames: object, rate: object, limits: VideoLimits, what: str = "video") -> Video:
    """(frames [T, H, W, 3] uint8, frames per second) -> its sampled frames and times."""
    x = np.asarray(frames)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or x.shape[0] == 0:
        raise UserInputError(f"{what}: frames must be a non-empty uint8 array [T, H, W, 3], got {x.dtype} {x.shape}")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise UserInputError(f"{what}: the frame rate must be a positive number, got {rate!r}")
    if x.shape[0] / rate > limits.max_seconds:
        raise UserInputError(f"{what} is {x.shape[0] / rate:.1f} s long; the limit is {limits.max_seconds:g} s")
    wanted = sample_indices(x.shape[0], limits.max_frames)
    return Video(x[wanted], [float(i) / rate for i in wanted])


def load_video(video: object, limits: VideoLimits, what: str = "video") -> Video:
    """Encoded bytes, a `data:video/...;base64,...` URL, (frames, fps), or (the Python API's) a file path."""
    if isinstance(video, Video):
        return video
    if isinstance(video, tuple) and len(video) == 2:
        return frames_video(video[0], video[1], limits, what)
    if isinstance(video, (bytes, bytearray)):
        return decode_video_bytes(bytes(video), limits, what)
    if isinstance(video, str) and video.startswith("data:"):
        return decode_video_bytes(data_url_bytes(video, limits.max_bytes, what, "MP4/WebM/MKV"), limits, what)
    if isinstance(video, dict) and isinstance(video.get("data"), str):   # {"data": base64}
        return decode_video_bytes(base64_bytes(video["data"], limits.max_bytes, what), limits, what)
    if isinstance(video, (str, Path)):
        path = Path(video).expanduser()
        if not path.is_file():
            raise UserInputError(f"{what}: no such file {str(path)!r}")
        if path.stat().st_size > limits.max_bytes:
            raise UserInputError(f"{what} is {path.stat().st_size} bytes; the limit is {limits.max_bytes}")
        return decode_video_bytes(path.read_bytes(), limits, f"{what} ({path.name})")
    raise UserInputError(f"{what}: expected encoded bytes, a data URL, (frames, fps) or a path, "
                         f"got {type(video).__name__}")
