"""bench/serve.py's servers: the benchmark model and its word-level tokenizer, and the
jaxserve / vLLM server subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput  # noqa: E402
from _metrics import ModelShape  # noqa: E402
from _serve_presets import SERVED_NAME, TINY_VOCAB, ServePreset  # noqa: E402

# ---- the model and its tokenizer -------------------------------------------------------------


def ensure_wordlevel_tokenizer(folder: Path, vocab_size: int, max_len: int) -> Path:
    """A word-level tokenizer of exactly vocab_size ids (<pad> <s> </s> <unk>, then "w3" ...),
    written once: every non-special id decodes to a word of its own, so each streamed token
    carries text on both servers. Both read tokenizer.json + tokenizer_config.json."""
    marker = folder / "bench_tokenizer.json"
    wanted = json.dumps({"vocab_size": vocab_size, "max_len": max_len, "kind": "wordlevel-v1"})
    if marker.exists() and marker.read_text() == wanted:
        return folder
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(wanted)
    return folder


@dataclass
class Model:
    name: str
    path: str  # the folder, or the built-in name
    tokenizer: str | None  # a tokenizer folder for both servers (None: the model's own)
    vocab_size: int
    shape: ModelShape | None  # None for a built-in model
    builtin: bool


def prepare_model(preset: ServePreset, cache: Path) -> Model:
    if preset.builtin:
        return Model(preset.model, preset.model, None, TINY_VOCAB, None, True)
    tp = throughput.PRESETS[preset.model]
    folder = throughput.ensure_checkpoint(tp, cache)
    cfg = json.loads((folder / "config.json").read_text())
    shape = ModelShape.from_hf_config(cfg)
    tok = ensure_wordlevel_tokenizer(
        cache / f"{tp.model_name}-wordlevel-tokenizer",
        shape.vocab,
        preset.engine["max_model_len"],
    )
    return Model(tp.model_name, str(folder), str(tok), shape.vocab, shape, False)


# ---- server processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess (its own process group), its log file and its health wait."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path) -> None:
        self.name, self.cmd, self.env, self.port, self.log_path = name, cmd, env, port, log_path
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(HERE.parent),
            start_new_session=True,
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll GET /health until 200; raise if the process exits or the time runs out.
        Returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was healthy:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(
                    f"{self.name} not healthy after {timeout_s:.0f} s:\n" + self.log_tail()
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> dict:
        """SIGINT (a clean shutdown), then SIGTERM and SIGKILL to its process group, each
        bounded. Returns how it ended."""
        out = {"signal": None, "returncode": None}
        if self.proc is None:
            return out
        steps = (
            (signal.SIGINT, grace_s, False),
            (signal.SIGTERM, 15, True),
            (signal.SIGKILL, 15, True),
        )
        for sig, wait_s, group in steps:
            if self.proc.poll() is not None:
                break
            out["signal"] = sig.name
            try:
                if group:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        # Children (vLLM's engine core and worker) left in its process group, if any.
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            time.sleep(1.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out["returncode"] = self.proc.poll()
        self._log.close()
        return out


def jaxserve_command(
    model: Model,
    engine: dict,
    port: int,
    compile_cache: Path,
    seed: int,
    async_scheduling: bool | None = None,
) -> list[str]:
    """`jaxserve serve`'s command line; ``async_scheduling`` None leaves it to the plan. The
    server warms every shape up before it serves (no background warm-up): the load measures
    a warmed server, as vLLM's captures its graphs first."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model.path]
    cmd.append("--no-enable-background-warmup")
    if async_scheduling is not None:
        cmd.append("--async-scheduling" if async_scheduling else "--no-async-scheduling")
    if model.tokenizer:
        cmd += ["--tokenizer", model.tokenizer]
    cmd += [
        "--dtype", "float32",
        "--block-size", str(engine["block_size"]),
        "--num-kv-blocks", str(engine["num_kv_blocks"] + 1),  # + jaxserve's null block
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--compilation-cache-dir", str(compile_cache),
        "--seed", str(seed),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return cmd


def vllm_command(python: str, model: Model, engine: dict, port: int, seed: int) -> list[str]:
    """vLLM's OpenAI server module (0.32: request logging is off by default, so no
    --disable-log-requests; the KV pool is sized in bytes to jaxserve's usable blocks)."""
    kv_bytes = engine["num_kv_blocks"] * engine["block_size"] * model.shape.kv_bytes_per_token
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model.path]
    if model.tokenizer:
        cmd += ["--tokenizer", model.tokenizer]
    cmd += [
        "--dtype", "float32",
        "--block-size", str(engine["block_size"]),
        "--max-num-seqs", str(engine["max_num_seqs"]),
        "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
        "--max-model-len", str(engine["max_model_len"]),
        "--kv-cache-memory-bytes", str(kv_bytes),
        "--seed", str(seed),
        "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    return cmd
