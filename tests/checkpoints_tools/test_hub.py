"""Hugging Face Hub model IDs, offline: a hub cache laid out here in huggingface_hub's layout
(models--org--name/snapshots/<commit>/, refs/<branch>) with tiny checkpoints, HF_HOME and
HF_HUB_OFFLINE=1 set by monkeypatch. LLM("org/name") loads and generates, revision= picks a
snapshot by ref or commit hash, an unknown ID gets one error naming the three things tried,
and only the files the engine reads are fetched (a recording snapshot_download, no network)."""

from __future__ import annotations

import pathlib

import huggingface_hub
import pytest
from huggingface_hub import errors

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoints_tools import hub
from jaxserve.checkpoints_tools.load import (
    declared_dtype,
    load_arch,
    load_checkpoint,
    resolve_model,
)
from jaxserve.checkpoints_tools.testing import write_tiny_hf_checkpoint
from jaxserve.config import EngineConfig

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40  # refs/main
V2 = "0123456789abcdef0123456789abcdef01234567"  # refs/v2: another vocabulary
SMALL = dict(
    block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, warmup=False
)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """HF_HOME with one cached model of two snapshots: main (vocab 512), v2 (vocab 384)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = hub.repo_folder(home / "hub", REPO)
    write_tiny_hf_checkpoint(repo / "snapshots" / MAIN, seed=0)
    write_tiny_hf_checkpoint(repo / "snapshots" / V2, seed=1, vocab_size=384)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return home


@pytest.fixture
def offline(hf_home: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """HF_HOME = hf_home, HF_HUB_OFFLINE=1; the hub cache folder."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home / "hub"


def snapshot(cache: pathlib.Path, commit: str) -> str:
    return str(hub.repo_folder(cache, REPO) / "snapshots" / commit)


@pytest.mark.parametrize(
    ("name", "is_id"),
    [
        ("org/name", True),
        ("meta-llama/Meta-Llama-3-8B", True),
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("gpt2", True),
        ("/abs/path", False),
        ("./org/name", False),
        ("~/models/x", False),
        ("a/b/c", False),
        ("org/..", False),
        ("org--x/name", False),
        ("org/name.git", False),
        ("org/", False),
        ("x" * 97, False),
    ],
)
def test_hub_id_form(name: str, is_id: bool) -> None:
    assert hub.is_hub_id(name) is is_id


def test_cache_folder_and_offline_follow_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.hub_cache_dir() == tmp_path / "cache"
    assert hub.hub_cache_dir(tmp_path / "dl") == tmp_path / "dl"  # download_dir wins
    assert not hub.hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.hub_offline()


def test_revision_by_ref_or_commit(offline: pathlib.Path) -> None:
    assert resolve_model(REPO) == snapshot(offline, MAIN)
    assert resolve_model(REPO, revision="v2") == snapshot(offline, V2)
    assert resolve_model(REPO, revision=V2) == snapshot(offline, V2)
    assert load_arch(REPO).vocab_size == 512
    assert load_arch(REPO, revision="v2").vocab_size == 384
    assert declared_dtype(REPO) == "float32"
    ckpt = load_checkpoint(REPO, revision=V2)
    assert ckpt.arch.vocab_size == 384 and ckpt.path == snapshot(offline, V2)
    # download_dir is the cache folder (vLLM's meaning): the same snapshot through it.
    assert resolve_model(REPO, download_dir=str(offline)) == snapshot(offline, MAIN)


@pytest.mark.slow
def test_llm_loads_a_hub_id_and_generates(offline: pathlib.Path) -> None:
    llm = LLM(REPO, **SMALL)
    assert llm.engine.info.vocab_size == 512 and llm.engine.config.model.model == REPO
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1 and out[0].prompt_token_ids
    v2 = LLM(REPO, revision="v2", **SMALL)
    assert v2.engine.info.vocab_size == 384
    assert v2.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_id_one_error_naming_what_was_tried(offline: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        LLM("tiny-org/no-such-model", **SMALL)
    message = str(info.value)
    assert message.startswith("model 'tiny-org/no-such-model' is neither a built-in model")
    assert "nor an existing folder, nor a Hugging Face Hub model that resolves" in message
    assert f"HF_HUB_OFFLINE is set and the hub cache {offline} has no snapshot" in message
    with pytest.raises(FileNotFoundError, match=rf"no snapshot of '{REPO}' at revision 'v9' .*"):
        load_arch(REPO, revision="v9")
    with pytest.raises(FileNotFoundError, match=f"cached commits: .*'{V2}'"):
        load_arch(REPO, revision="v9")
    with pytest.raises(FileNotFoundError, match=r"'a/b/c' is neither .* no such folder"):
        load_arch("a/b/c")


def test_hub_arguments_are_refused_where_they_cannot_apply(offline: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"revision='v2': applies to .* is a built-in model"):
        LLM("tiny-random-llama", revision="v2", **SMALL)
    folder = snapshot(offline, MAIN)
    with pytest.raises(ValueError, match=r"download_dir='x': applies to .* is a local folder"):
        load_arch(folder, download_dir="x")
    with pytest.raises(TypeError, match="ModelConfig.revision must be a branch, tag or commit"):
        EngineConfig.from_kwargs(revision="")
    with pytest.raises(TypeError, match="ModelConfig.download_dir must be a folder path"):
        EngineConfig.from_kwargs(download_dir=3)


class RecordingDownload:
    """A snapshot_download that records its arguments and returns a prepared folder."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.calls: list[dict] = []

    def __call__(self, repo_id: str, **kwargs: object) -> str:
        self.calls.append({"repo_id": repo_id, **kwargs})
        return self.folder


@pytest.fixture
def recording(
    offline: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[RecordingDownload, pathlib.Path]:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake = RecordingDownload(snapshot(offline, MAIN))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake, offline


def test_only_the_files_the_engine_reads_are_fetched(
    recording: tuple[RecordingDownload, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    fake, cache = recording
    LLM(REPO, **SMALL)
    # config.json alone first (plan and memory check), then the checkpoint's files.
    assert [c["allow_patterns"] for c in fake.calls] == [
        ["config.json"],
        list(hub.CHECKPOINT_FILES),
    ]
    assert set(hub.CHECKPOINT_FILES) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer.model",  # a sentencepiece-only repository is refused naming it
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "*.safetensors",
        "model.safetensors.index.json",
    }
    assert all(c["revision"] == "main" and c["cache_dir"] == str(cache) for c in fake.calls)
    assert not any(c["local_files_only"] for c in fake.calls)
    fake.calls.clear()
    load_arch(REPO, revision="v2", download_dir=str(tmp_path / "dl"))
    assert fake.calls == [
        {
            "repo_id": REPO,
            "revision": "v2",
            "cache_dir": str(tmp_path / "dl"),
            "allow_patterns": ["config.json"],
            "local_files_only": False,
            "library_name": "jaxserve",
        }
    ]


def _hub_error(cls: type[Exception], message: str) -> Exception:
    # The HTTP errors want a response object; their type is all hub_snapshot looks at.
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize(
    ("error", "match"),
    [
        (_hub_error(errors.RepositoryNotFoundError, "404"), "the Hub has no model 'org/x'"),
        (_hub_error(errors.GatedRepoError, "403"), "'org/x' is a gated model on the Hub"),
        (_hub_error(errors.RevisionNotFoundError, "404"), "has no revision 'main'"),
        (errors.LocalEntryNotFoundError("no net"), "the Hub could not be reached"),
    ],
)
def test_hub_failures_are_explained(
    error: Exception, match: str, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def failing(repo_id: str, **kwargs: object) -> str:
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(FileNotFoundError, match=match) as info:
        resolve_model("org/x", download_dir=str(tmp_path))
    assert str(info.value).startswith("model 'org/x' is neither a built-in model")
