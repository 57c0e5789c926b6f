"""`ServerConfig`: the options of `gemmaserve serve` (HTTP, overload, deadlines, shutdown). Its own
module, free of fastapi and torch, so the command line can build its parser without importing them."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.options import number, option, port_number, positive_int, size
from ..errors import UserInputError


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, parse=port_number, help="TCP port (0: any free port, printed at startup)")
    api_key: str | None = option(None, help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 routes")
    served_model_name: list[str] | str | None = option(
        None, nargs=True, help="the names clients may send for the model (several: any of them; responses name the "
                               "first; default: --model)")
    max_request_bytes: int = option(8 << 20, parse=size, help="largest request body accepted (413 above)")
    max_images_per_request: int = option(8, parse=positive_int, help="most images in one chat request")
    max_image_pixels: int = option(40_000_000, parse=positive_int, help="most pixels (width x height) of one image")
    max_image_bytes: int = option(8 << 20, parse=size, help="largest encoded image (after base64 decoding)")
    max_audio_per_request: int = option(4, parse=positive_int, help="most audio inputs in one chat request")
    max_audio_seconds: float = option(
        600.0, parse=number, help="longest audio input in seconds (split into the encoder's 30 s clips)")
    max_audio_bytes: int = option(25 << 20, parse=size,
                                  help="largest encoded audio input (a transcription upload may be this large)")
    max_videos_per_request: int = option(2, parse=positive_int, help="most videos in one chat request")
    max_video_frames: int = option(32, parse=positive_int,
                                   help="frames sampled from one video (uniformly; each takes an image's tokens)")
    max_video_bytes: int = option(32 << 20, parse=size, help="largest encoded video (after base64 decoding)")
    lora_root: str | None = option(
        None, help="directory under which POST /v1/load_lora_adapter may load LoRA adapters (a path outside it, a "
                   "link out of it or a URL is refused); unset: adapters come from --lora-modules only")
    max_queue_len: int | None = option(
        None, parse=positive_int,
        help="most completions waiting beyond --max-num-seqs running ones: at most their sum are in the server, "
             "and a request that would exceed it gets 429 with Retry-After (default: unbounded)")
    request_timeout: float | None = option(
        None, parse=number,
        help="seconds a request may take from arrival to its last token; past it the request is aborted, its KV "
             "pages freed, and the client gets 408 (a request's own 'request_timeout' field may only shorten it)")
    shutdown_timeout: float = option(
        30.0, parse=number,
        help="on SIGTERM, seconds to let running requests finish (new ones get 503) before aborting them")
    responses_store_max_items: int = option(
        1000, parse=positive_int, help="most responses /v1/responses keeps for previous_response_id and GET (the "
                                       "oldest are dropped first)")
    responses_store_max_bytes: int = option(64 << 20, parse=size, help="most bytes of stored responses (as JSON)")
    responses_store_ttl: float = option(3600.0, parse=number, help="seconds a stored response is kept")

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise UserInputError("host must be a non-empty address")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise UserInputError(f"port must be in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise UserInputError("api_key must be a non-empty string (or unset for no authentication)")
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        if names is not None and (not names or not all(isinstance(n, str) and n.strip() for n in names)):
            raise UserInputError(f"served_model_name must be one or more non-empty names, got "
                                 f"{self.served_model_name!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise UserInputError(f"max_request_bytes must be at least 1KiB, got {self.max_request_bytes!r}")
        if self.max_queue_len is not None and (not isinstance(self.max_queue_len, int) or self.max_queue_len < 1):
            raise UserInputError(f"max_queue_len must be at least 1, got {self.max_queue_len!r}")
        if self.request_timeout is not None and not _positive(self.request_timeout):
            raise UserInputError(f"request_timeout must be a positive number of seconds, got {self.request_timeout!r}")
        if not _positive(self.max_audio_seconds):
            raise UserInputError(f"max_audio_seconds must be a positive number, got {self.max_audio_seconds!r}")
        if self.lora_root is not None and not (isinstance(self.lora_root, str) and self.lora_root.strip()):
            raise UserInputError("lora_root must be a directory")
        for name in ("responses_store_max_items", "responses_store_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserInputError(f"{name} must be a positive integer, got {value!r}")
        if not _positive(self.responses_store_ttl):
            raise UserInputError(f"responses_store_ttl must be a positive number of seconds, got "
                                 f"{self.responses_store_ttl!r}")
        if not _positive(self.shutdown_timeout, zero_ok=True):
            raise UserInputError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")

    @property
    def audio_limits(self):
        from ..engine.media.audio import AudioLimits

        return AudioLimits(self.max_audio_per_request, self.max_audio_bytes, self.max_audio_seconds)

    @property
    def video_limits(self):
        from ..engine.media.video import VideoLimits

        return VideoLimits(self.max_videos_per_request, self.max_video_bytes, self.max_video_frames)

    @property
    def image_limits(self):
        from ..engine.media.images import ImageLimits

        return ImageLimits(self.max_images_per_request, self.max_image_pixels, self.max_image_bytes)


def _positive(value: object, zero_ok: bool = False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value != float("inf")
    return ok and (value >= 0 if zero_ok else value > 0)
