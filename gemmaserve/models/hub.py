"""Models by Hugging Face Hub name: `--model ORG/NAME` (or `ORG/NAME:FILE.gguf`) fetched with huggingface_hub.

Files go into the standard Hugging Face cache (`--download-dir`, else $HF_HUB_CACHE, else $HF_HOME/hub), so
they are shared with transformers and vLLM and reused on the next start; `HF_HUB_OFFLINE=1` serves from it
without a request. Only what the engine reads is fetched: configs, tokenizer, chat template, processor configs
and the weights of one format (safetensors when the repository has them, else one .gguf file). A GGUF repository
gives its model file only, text-only like a local .gguf file: `--mmproj NAME` fetches that file of the same
repository (a repository's several mmproj files differ in precision, so none is picked for the user).

huggingface_hub writes each file to a temporary `blobs/<etag>.<id>.incomplete` and links it into the snapshot
only once whole. A dropped connection is resumed by Range within the run (a few tries); a download that fails
anyway deletes its temporary file (huggingface_hub 2.x names it per process, so that no two processes append to
one file), so nothing partial is left and the next run fetches that file again (files already whole are kept).

The environment is read when a model is fetched, not when huggingface_hub is imported (its module constants
are frozen at import): a process that changes HF_ENDPOINT, HF_HOME or HF_HUB_OFFLINE is obeyed.
"""

from __future__ import annotations

import enum
import fnmatch
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import UserInputError

# What the engine reads from a checkpoint directory besides its weights (loader.py, tokenizer.py).
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                    "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                    "model.safetensors.index.json")
_MMPROJ = "mmproj*.gguf"
# ORG/NAME as the Hub spells it (huggingface_hub checks the details); an optional :FILE.gguf after it.
_HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^:]+\.gguf))?", re.IGNORECASE)
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubFormat(enum.Enum):
    CHECKPOINT = "checkpoint"   # config.json + *.safetensors: the snapshot directory is the model
    GGUF = "gguf"               # one .gguf file


@dataclass(frozen=True)
class HubOptions:
    """How to fetch a Hub model (--revision, --gguf-file, --hf-token, --download-dir); ignored for local paths."""
    revision: str | None = None       # branch, tag or commit; None = the default branch
    gguf_file: str | None = None      # the .gguf file of a GGUF repository
    token: str | None = None          # None = huggingface_hub's own (HF_TOKEN, `hf auth login`)
    download_dir: str | None = None   # the cache directory instead of the standard one

    def __post_init__(self) -> None:
        for option, value in (("revision", self.revision), ("gguf_file", self.gguf_file), ("hf_token", self.token),
                              ("download_dir", self.download_dir)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UserInputError(f"{option} must be a non-empty string, got {value!r}")

    @property
    def given(self) -> list[str]:
        """The options set that only a Hub name uses."""
        return [flag for flag, value in (("--revision", self.revision), ("--gguf-file", self.gguf_file))
                if value is not None]


@dataclass(frozen=True)
class HubSpec:
    """A Hub model as the user named it, with the options of how to fetch it."""
    repo_id: str
    revision: str | None = None
    gguf_file: str | None = None      # from ORG/NAME:FILE.gguf or --gguf-file
    token: str | None = None
    download_dir: Path | None = None

    @classmethod
    def parse(cls, name: str, options: HubOptions = HubOptions()) -> "HubSpec | None":
        """The spec of `name` when it is a Hub name (ORG/NAME[:FILE.gguf]); None when it is not one (a path)."""
        if name.startswith((".", "/", "~")):
            return None
        m = _HUB_NAME.fullmatch(name)
        if m is None:
            return None
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(m["repo"])
        except HFValidationError as exc:
            raise UserInputError(f"model {name!r} is not a Hugging Face repository name: {exc}") from None
        if m["file"] and options.gguf_file and m["file"] != options.gguf_file:
            raise UserInputError(f"model {name!r} names the file {m['file']!r} but --gguf-file says "
                                 f"{options.gguf_file!r}")
        download_dir = Path(options.download_dir).expanduser() if options.download_dir else None
        return cls(m["repo"], options.revision, m["file"] or options.gguf_file, options.token, download_dir)

    @property
    def page(self) -> str:
        """The repository's page on the Hub (where a gated model's licence is accepted)."""
        return f"{endpoint()}/{self.repo_id}"

    @property
    def label(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubModel:
    """A fetched model: `path` is the snapshot directory (checkpoint) or the .gguf file."""
    spec: HubSpec
    commit: str
    snapshot: Path
    format: HubFormat
    files: tuple[str, ...]

    @property
    def path(self) -> Path:
        return self.snapshot if self.format is HubFormat.CHECKPOINT else self.snapshot / self.files[0]


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f is not None and f.upper() in _TRUE for f in flags)


def cache_dir(spec: HubSpec) -> Path:
    """huggingface_hub's rule for the cache, read now: --download-dir, $HF_HUB_CACHE, $HF_HOME/hub,
    $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    if spec.download_dir is not None:
        return spec.download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def select_files(spec: HubSpec, files: list[str]) -> tuple[HubFormat, list[str]]:
    """Which of a repository's `files` the engine needs: a checkpoint's configs, tokenizer and root-level
    safetensors weights (never .bin/.pt/ONNX/TFLite/GGUF copies beside them), or one .gguf file."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and not fnmatch.fnmatch(PurePosixPath(f).name.lower(), _MMPROJ))
    if spec.gguf_file is not None:
        if spec.gguf_file not in files:
            listed = ", ".join(ggufs) if ggufs else "none"
            raise UserInputError(f"{spec.label} has no file {spec.gguf_file!r} (its .gguf files: {listed})")
        return HubFormat.GGUF, [spec.gguf_file]
    weights = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if "config.json" in files and weights:
        return HubFormat.CHECKPOINT, [f for f in CHECKPOINT_FILES if f in files] + weights
    if len(ggufs) == 1:
        return HubFormat.GGUF, ggufs
    if ggufs:
        raise UserInputError(f"{spec.label} holds several .gguf files; choose one as {spec.repo_id}:FILE.gguf or with "
                             f"--gguf-file FILE.gguf: {', '.join(ggufs)}")
    if "config.json" in files:
        others = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".onnx", ".tflite", ".msgpack", ".h5")))
        found = f" (it has {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
        raise UserInputError(f"{spec.label} has no .safetensors weights at its root{found}: gemmaserve reads "
                             "safetensors checkpoints and GGUF files")
    raise UserInputError(f"{spec.label} is not a model repository gemmaserve can load: it has neither config.json "
                         "with .safetensors weights nor a .gguf file")


def fetch(spec: HubSpec) -> HubModel:
    """Resolve `spec`'s revision, choose its files and download those not yet in the cache (huggingface_hub's
    progress bars on stderr; HF_HUB_DISABLE_PROGRESS_BARS=1 quiets them). Every failure is a UserInputError
    that names the repository, and the file where one was being fetched."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=spec.token)
    cache, local = cache_dir(spec), offline()
    with _errors(spec, None, local):
        revision = api.resolve_revision(spec.repo_id, revision=spec.revision, cache_dir=cache, token=spec.token,
                                        local_files_only=local)
    snapshot = _snapshot_dir(cache, spec.repo_id, revision.resolved)
    if local:   # what an earlier run fetched is what there is to choose from
        listed = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        try:
            kind, chosen = select_files(spec, listed)
        except UserInputError as exc:
            raise UserInputError(f"HF_HUB_OFFLINE is set, and in the cache ({snapshot}) {exc}") from None
    else:
        with _errors(spec, None, local):
            listed = api.list_repo_files(spec.repo_id, revision=revision.resolved, token=spec.token)
        kind, chosen = select_files(spec, listed)
    for name in chosen:
        _download(spec, revision, name, cache, local)
    return HubModel(spec, revision.resolved, snapshot, kind, tuple(chosen))


def fetch_file(model: HubModel, name: str) -> Path:
    """One more file of an already fetched model's repository, at the same commit (a GGUF model's mmproj)."""
    from huggingface_hub import ResolvedRevision

    revision = ResolvedRevision(model.commit, model.spec.revision, model.spec.repo_id)
    return _download(model.spec, revision, name, cache_dir(model.spec), offline())


def _download(spec: HubSpec, revision: str, name: str, cache: Path, local: bool) -> Path:
    from huggingface_hub import hf_hub_download

    with _errors(spec, name, local):
        return Path(hf_hub_download(spec.repo_id, name, revision=revision, cache_dir=cache, token=spec.token,
                                    endpoint=endpoint(), local_files_only=local))


def _snapshot_dir(cache: Path, repo_id: str, commit: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / commit


@contextmanager
def _errors(spec: HubSpec, name: str | None, local: bool) -> Iterator[None]:
    """huggingface_hub's exceptions, and the network's, as UserInputErrors a user can act on."""
    try:
        yield
    except UserInputError:
        raise
    except Exception as exc:
        message = _message(exc, spec, name, local)
        if message is None:
            raise
        raise UserInputError(message) from exc


def _message(exc: Exception, spec: HubSpec, name: str | None, local: bool) -> str | None:
    import httpx2
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError,
                                        RevisionResolutionError)

    what = spec.label + (f": {name}" if name else "")
    if isinstance(exc, GatedRepoError):
        return (f"{spec.repo_id} is a gated repository this token cannot read: accept its licence at {spec.page} "
                "and set HF_TOKEN (or --hf-token) to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"Hub model {spec.repo_id!r} was not found at {endpoint()} or needs a token (a private repository: "
                "set HF_TOKEN or --hf-token)")
    if isinstance(exc, RevisionNotFoundError):
        return f"{spec.repo_id} has no revision {spec.revision!r} (a branch, tag or commit of {spec.page})"
    if local and isinstance(exc, (LocalEntryNotFoundError, RevisionResolutionError, OfflineModeIsEnabled)):
        return (f"{what} is not in the Hugging Face cache ({cache_dir(spec)}) and HF_HUB_OFFLINE is set: fetch it "
                f"once online (gemmaserve download {spec.repo_id})")
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return f"{what}: no such file in the repository at this revision"
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return (f"{what}: the Hub at {endpoint()} answered HTTP {exc.response.status_code}; nothing partial is left "
                "behind: run again to fetch it")
    if isinstance(exc, PermissionError):
        return f"{what}: cannot write the Hugging Face cache ({exc}); choose another with --download-dir"
    if isinstance(exc, (httpx2.TransportError, RevisionResolutionError, LocalEntryNotFoundError, OSError)):
        first = str(exc).splitlines()[0] if str(exc) else ""
        return (f"{what}: could not download from the Hub at {endpoint()} ({type(exc).__name__}: {first}); nothing "
                "partial is left behind: run again to fetch it")
    return None
