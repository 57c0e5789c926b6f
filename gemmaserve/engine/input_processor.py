"""Preparing a request's input: prompt text to token ids, images, audio and videos to what their encoder reads,
in place (`LLMEngine.inputs`, public: the server, `LLM` and the CLI prepare requests through it). Whether the
prepared request can ever run is validation.py's.

Every user-facing entry point (CLI, `LLM`, HTTP) goes through here, so each says the same thing about
the same bad input (a `UserInputError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserInputError
from ..models.multimodal import EncoderInput, MediaLayout, Modality
from .media.audio import AudioLimits, load_audio, split_clips
from .media.images import ImageLimits, load_image
from .media.items import MediaInput, MediaItem, expand_prompt, place_media
from .media.video import VideoLimits, load_video

# A request's images, audio and video as their encoders read them, by modality, before they have a place in the
# prompt
LoadedMedia = dict[Modality, list[MediaInput]]


@dataclass(frozen=True)
class InputProcessor:
    model_name: str
    tokenizer: object
    layouts: dict[Modality, MediaLayout] = field(default_factory=dict)   # what the model reads besides text
    media_hint: str = ""   # how the model could take media it does not take as loaded (a GGUF file's --mmproj)

    @property
    def image_layout(self) -> MediaLayout | None:
        return self.layouts.get(Modality.IMAGE)

    def _layout(self, modality: Modality) -> MediaLayout:
        if modality not in self.layouts:
            hint = f" ({self.media_hint})" if self.media_hint else ""
            raise UserInputError(f"model {self.model_name!r} does not take {modality.inputs}{hint}")
        return self.layouts[modality]

    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise UserInputError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise UserInputError("empty prompt")
        return self.tokenizer.encode(prompt)

    def load_images(self, images: list, limits: ImageLimits | None = None) -> list[EncoderInput]:
        """Pixels of each image (PIL images, uint8 numpy arrays, file paths, encoded bytes or data
        URLs), within `limits` (count, pixels, bytes)."""
        layout = self._layout(Modality.IMAGE)
        limits = limits or ImageLimits()
        if len(images) > limits.max_images:
            raise UserInputError(f"{len(images)} images; at most {limits.max_images} per request")
        return [layout.processor(load_image(im, limits, f"image {i}")) for i, im in enumerate(images)]

    def load_audio(self, audio: list, limits: AudioLimits | None = None) -> list[MediaInput]:
        """Features of each audio input (samples, (samples, rate), encoded bytes, data URLs or file paths), split
        into the clips the encoder takes at once (30 s; each cut in the quietest moment of the 2 s before), within
        `limits` (count, bytes, duration)."""
        layout = self._layout(Modality.AUDIO)
        limits = limits or AudioLimits()
        if len(audio) > limits.max_clips:
            raise UserInputError(f"{len(audio)} audio inputs; at most {limits.max_clips} per request")
        rate = layout.processor.config.sampling_rate
        out = []
        for i, a in enumerate(audio):
            samples = load_audio(a, rate, limits, f"audio {i}")
            # cuts fall at least 28 s into a clip: only an input this short can give a clip of no token
            clips = [layout.processor(c) for c in split_clips(samples, layout.processor.config.max_samples, 2 * rate)]
            if not clips[-1].num_tokens:
                raise UserInputError(f"audio {i} is {1000 * len(samples) / rate:.1f} ms long: too short for one "
                                     f"audio token ({layout.processor.min_seconds * 1000:.0f} ms at least)")
            out.append(MediaInput(clips))
        return out

    def load_videos(self, videos: list, limits: VideoLimits | None = None) -> list[MediaInput]:
        """Frames of each video (encoded bytes, data URLs, file paths, or (frames, fps)), sampled uniformly (at most
        `limits.max_frames`), each frame prepared as an image and labelled with its time stamp."""
        layout = self._layout(Modality.VIDEO)
        limits = limits or VideoLimits()
        if len(videos) > limits.max_videos:
            raise UserInputError(f"{len(videos)} videos; at most {limits.max_videos} per request")
        out = []
        for i, v in enumerate(videos):
            video = load_video(v, limits, f"video {i}")
            try:
                frames = [layout.processor(frame) for frame in video.frames]
            except UserInputError as exc:
                raise UserInputError(f"video {i}: {exc}") from None
            out.append(MediaInput(frames, video.stamps()))
        return out

    def load_media(self, images: list | None = None, audio: list | None = None, videos: list | None = None,
                   image_limits: ImageLimits | None = None, audio_limits: AudioLimits | None = None,
                   video_limits: VideoLimits | None = None) -> LoadedMedia:
        """What the encoders read of a request's images, audio and videos (decoded, checked against the limits)."""
        media: LoadedMedia = {}
        if images:
            media[Modality.IMAGE] = [MediaInput([x]) for x in self.load_images(list(images), image_limits)]
        if audio:
            media[Modality.AUDIO] = self.load_audio(list(audio), audio_limits)
        if videos:
            media[Modality.VIDEO] = self.load_videos(list(videos), video_limits)
        return media

    def expand(self, text: str, media: LoadedMedia) -> str:
        """`text` with every placeholder written out as its input's tokens (see media.expand_prompt)."""
        return expand_prompt(text, media, self.layouts)

    def place(self, token_ids: list[int], media: LoadedMedia) -> list[MediaItem]:
        return place_media(token_ids, media, self.layouts)

    def prepare(self, prompt: str, images: list | None = None, audio: list | None = None, videos: list | None = None,
                image_limits: ImageLimits | None = None, audio_limits: AudioLimits | None = None,
                video_limits: VideoLimits | None = None) -> tuple[list[int], list[MediaItem]]:
        """Prompt ids with the tokens of each image, clip and video frame in place, and the items (what the encoder
        reads, content keys). The prompt marks where each input goes with the model's placeholder of its kind
        (none: they go first)."""
        media = self.load_media(images, audio, videos, image_limits, audio_limits, video_limits)
        if not media:
            return self.tokenize(prompt), []
        ids = self.tokenize(self.expand(prompt, media))
        return ids, self.place(ids, media)

    def prepare_images(self, prompt: str, images: list, limits: ImageLimits | None = None
                       ) -> tuple[list[int], list[MediaItem]]:
        return self.prepare(prompt, images=images, image_limits=limits)
