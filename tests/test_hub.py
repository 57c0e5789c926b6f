"""Models by Hub name (`--model ORG/NAME`), fetched by the real huggingface_hub client from a local server
that answers the Hub's routes (tests/fake_hub.py) through HF_ENDPOINT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemmaserve import LLM, SamplingParams
from gemmaserve.errors import UserInputError
from gemmaserve.models.hub import HubFormat, HubOptions, HubSpec, fetch, fetch_file
from gemmaserve.models.loader import SourceKind, resolve_model

from fake_hub import FakeHub, FakeRepo, Fault, commit_sha
from helpers import fresh_seed, save_checkpoint, tiny_hf_model

TOKEN = "hf_fake_token"
WANTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
A, B = commit_sha("a"), commit_sha("b")


def _tiny_gguf(path: Path, name: str) -> bytes:
    import gguf

    w = gguf.GGUFWriter(str(path / name), "gemma3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return (path / name).read_bytes()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path_factory.mktemp("hub") / "ckpt")


@pytest.fixture(scope="module")
def hub(checkpoint, tmp_path_factory):
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    assert WANTED <= set(files)
    extras = {"pytorch_model.bin": b"pickle" * 100, "onnx/model.onnx": b"onnx" * 100, "README.md": b"# tiny"}
    v2 = dict(files, **{"generation_config.json": b'{"eos_token_id": 1, "revision": "v2"}'})
    gdir = tmp_path_factory.mktemp("gguf")
    one = {"model-Q4_K_M.gguf": _tiny_gguf(gdir, "m.gguf"), "mmproj-F16.gguf": _tiny_gguf(gdir, "p.gguf"),
           "README.md": b"# gguf"}
    many = {"model-Q4_K_M.gguf": one["model-Q4_K_M.gguf"], "model-Q8_0.gguf": one["mmproj-F16.gguf"]}
    flaky = {"config.json": files["config.json"], "model.safetensors": files["model.safetensors"]}
    server = FakeHub({
        "tiny/gemma3": FakeRepo({A: dict(files, **extras), B: v2}, {"main": A, "v2": B}),
        "tiny/gated": FakeRepo({A: files}, {"main": A}, access="gated"),
        "tiny/private": FakeRepo({A: files}, {"main": A}, access="private"),
        "tiny/gguf-one": FakeRepo({A: one}, {"main": A}),
        "tiny/gguf-many": FakeRepo({A: many}, {"main": A}),
        "tiny/flaky": FakeRepo({A: flaky}, {"main": A}),
    }, token=TOKEN).start()
    yield server
    server.stop()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    """A fresh Hugging Face cache per test, the fake hub as the endpoint, no token."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    hub.take_requests()
    hub.fault = None
    return tmp_path / "hf" / "hub"


def _spec(name: str, **options) -> HubSpec:
    spec = HubSpec.parse(name, HubOptions(**options))
    assert spec is not None
    return spec


def _greedy(model: str, **options) -> list[int]:
    with LLM(model=model, page_size=4, **options) as llm:
        out = llm.generate(["hello world"], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    return out.outputs[0].token_ids


def test_hub_name_generates_like_its_local_directory_then_offline_from_the_cache(hub, env, checkpoint, monkeypatch):
    want = _greedy(str(checkpoint))
    assert _greedy("tiny/gemma3") == want
    snapshot = env / "models--tiny--gemma3" / "snapshots" / A
    assert {p.name for p in snapshot.iterdir()} == WANTED   # no .bin, .onnx or README beside the safetensors
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.take_requests() if r.method == "GET" and "/resolve/" in r.path}
    assert fetched == WANTED
    assert resolve_model("tiny/gemma3").path == snapshot   # online again: files are reused, only listed
    assert not [r for r in hub.take_requests() if "/resolve/" in r.path]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _greedy("tiny/gemma3") == want
    assert hub.take_requests() == []


def test_revisions_branch_and_commit(hub, env, monkeypatch):
    v2 = fetch(_spec("tiny/gemma3", revision="v2"))
    assert v2.commit == B and b'"v2"' in (v2.path / "generation_config.json").read_bytes()
    pinned = fetch(_spec("tiny/gemma3", revision=A))
    assert pinned.commit == A and pinned.path.name == A and b'"v2"' not in (pinned.path / "generation_config.json").read_bytes()
    with pytest.raises(UserInputError, match=r"tiny/gemma3 has no revision 'nope'"):
        fetch(_spec("tiny/gemma3", revision="nope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # the branch was remembered (refs/v2)
    hub.take_requests()
    assert fetch(_spec("tiny/gemma3", revision="v2")).commit == B
    with pytest.raises(UserInputError, match=r"tiny/gemma3@main is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        fetch(_spec("tiny/gemma3", revision="main"))
    assert hub.take_requests() == []


def test_gated_private_and_missing_repositories(hub, env, monkeypatch):
    with pytest.raises(UserInputError, match=rf"gated .* accept its licence at {hub.url}/tiny/gated .*HF_TOKEN"):
        LLM(model="tiny/gated")
    for name in ("tiny/private", "tiny/absent"):
        with pytest.raises(UserInputError, match=rf"'{name}' was not found at {hub.url} or needs a token"):
            fetch(_spec(name))
    assert not list(env.glob("**/*.safetensors"))
    assert fetch(_spec("tiny/gated", token=TOKEN)).format is HubFormat.CHECKPOINT   # --hf-token
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert fetch(_spec("tiny/private")).path.joinpath("model.safetensors").is_file()
    assert {r.authorization for r in hub.take_requests()} >= {f"Bearer {TOKEN}"}


def test_gguf_repositories_fetch_one_chosen_file(hub, env):
    source = resolve_model("tiny/gguf-one")
    assert source.kind is SourceKind.GGUF and source.path.name == "model-Q4_K_M.gguf"
    assert source.path.read_bytes()[:4] == b"GGUF"
    assert {p.name for p in source.path.parent.iterdir()} == {"model-Q4_K_M.gguf"}   # no mmproj, no README
    assert fetch_file(source.hub, "mmproj-F16.gguf").read_bytes()[:4] == b"GGUF"      # --mmproj NAME
    with pytest.raises(UserInputError, match="tiny/gguf-one: nope.gguf: no such file"):
        fetch_file(source.hub, "nope.gguf")
    with pytest.raises(UserInputError, match="several .gguf files.*tiny/gguf-many:FILE.gguf.*"
                                             "model-Q4_K_M.gguf, model-Q8_0.gguf"):
        fetch(_spec("tiny/gguf-many"))
    assert fetch(_spec("tiny/gguf-many:model-Q8_0.gguf")).path.name == "model-Q8_0.gguf"
    assert fetch(_spec("tiny/gguf-many", gguf_file="model-Q4_K_M.gguf")).path.name == "model-Q4_K_M.gguf"
    with pytest.raises(UserInputError, match=r"no file 'x.gguf' \(its .gguf files: model-Q4_K_M.gguf, model-Q8_0"):
        fetch(_spec("tiny/gguf-many", gguf_file="x.gguf"))
    with pytest.raises(UserInputError, match="--gguf-file says"):
        _spec("tiny/gguf-many:model-Q8_0.gguf", gguf_file="model-Q4_K_M.gguf")


def test_interrupted_download_resumes_or_leaves_nothing_partial(hub, env, checkpoint, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)   # (10 MB) the tiny file is written in parts
    whole = (checkpoint / "model.safetensors").read_bytes()
    cut = len(whole) // 2
    repo = env / "models--tiny--flaky"
    hub.fault = Fault("model.safetensors", cut, then_503=True)   # dropped, then the Hub is down
    with pytest.raises(UserInputError, match=r"tiny/flaky: model.safetensors: .*HTTP 503.*nothing partial"):
        fetch(_spec("tiny/flaky"))
    assert (repo / "snapshots" / A / "config.json").is_file()
    assert not (repo / "snapshots" / A / "model.safetensors").exists()
    assert [p.read_bytes() for p in (repo / "blobs").iterdir()] == [(checkpoint / "config.json").read_bytes()]
    assert not list(repo.rglob("*.incomplete"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserInputError, match=r"HF_HUB_OFFLINE is set, and in the cache .* no .safetensors weights"):
        fetch(_spec("tiny/flaky"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.fault = Fault("model.safetensors", cut)   # dropped once: resumed where it stopped
    hub.take_requests()
    model = fetch(_spec("tiny/flaky"))
    assert (model.path / "model.safetensors").read_bytes() == whole
    ranges = [r.range for r in hub.take_requests() if r.method == "GET" and r.path.endswith("model.safetensors")]
    assert ranges == [None, f"bytes={cut >> 16 << 16}-"]   # what was written before the drop is kept
    assert not list(repo.rglob("*.incomplete"))


def test_names_paths_and_options(hub, env, checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "gemma3").symlink_to(checkpoint)
    assert resolve_model("tiny/gemma3").path == Path("tiny/gemma3")   # a local path wins over the Hub name
    assert hub.take_requests() == []
    with pytest.raises(UserInputError, match="--revision go with a Hugging Face Hub name; 'gemma3-270m' is a known"):
        resolve_model("gemma3-270m", HubOptions(revision="main"))
    for name in ("a/b/c", "./x/y", "no-slash"):
        with pytest.raises(UserInputError, match="neither a known alias"):
            resolve_model(name)
    with pytest.raises(UserInputError, match="not a Hugging Face repository name"):
        resolve_model("org/na..me")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing listens (discard port)
    with pytest.raises(UserInputError, match=r"tiny/other: could not download from the Hub at http://127.0.0.1:9"):
        resolve_model("tiny/other")
    with pytest.raises(UserInputError, match="revision must be a non-empty string"):
        LLM(model="tiny/gemma3", revision=" ")
    assert hub.take_requests() == []


def test_download_command(hub, env, tmp_path):
    base = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1",
                PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "gemmaserve", "download", "tiny/gemma3", "--revision", "v2",
           "--download-dir", str(tmp_path / "dl")]
    done = subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path == tmp_path / "dl" / "models--tiny--gemma3" / "snapshots" / B
    assert {p.name for p in path.iterdir()} == WANTED
    refused = subprocess.run([sys.executable, "-m", "gemmaserve", "download", "tiny/gated"], env=base,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and f"accept its licence at {hub.url}/tiny/gated" in refused.stderr


def test_a_benchmark_never_records_the_hub_token():
    from gemmaserve.config.engine import EngineConfig

    config = EngineConfig(model="org/name", hf_token="hf_secret_value")
    recorded = config.recorded()
    assert "hf_secret_value" not in repr(recorded) and recorded["hf_token"] == "<set>"
    assert recorded["model"] == "org/name" and set(recorded) == set(vars(config))
