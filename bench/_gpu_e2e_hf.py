"""bench/gpu_e2e.py's transformers phase, in a child process: `generate` in static, left-padded
batches on a fixed subset of the requests, cut at the phase's deadline.
"""

from __future__ import annotations

import time
from typing import Any

from _gpu_e2e_child_io import Result, spec_requests

PAD_ID = 0


def _hf_import_and_load(spec: dict, res: Result) -> tuple[Any, Any, str]:
    """Import torch and transformers and load the checkpoint, timing each in `res`.

    Returns:
        (the torch module, the model, its device: "cuda" or "cpu").
    """
    res["started_after_spawn_s"] = time.time() - spec["t_spawn"]
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    res["import_s"] = time.perf_counter() - t0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res.update(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        status="loading",
    )
    res.save()
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = _hf_load(AutoModelForCausalLM, spec["model_dir"], spec["dtype"], device, torch, res)
    res["load_s"] = time.perf_counter() - t0
    res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    res["status"] = "warming up"
    res.save()
    return torch, model, device


def child_hf(spec: dict, res: Result) -> None:
    """transformers `generate` on a fixed subset (see the module docstring)."""
    deadline = spec["deadline"]
    torch, model, device = _hf_import_and_load(spec, res)
    requests = spec_requests(spec)[: spec["hf_num_requests"]]
    batch_size = spec["hf_batch_size"]
    gen_kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=PAD_ID)
    t0 = time.perf_counter()
    _hf_generate(model, requests[:2], 4, gen_kw, device, torch, None)
    res["warmup_s"] = time.perf_counter() - t0
    res["status"] = "running"
    res.save()

    useful = generated = done_requests = 0
    truncated = False
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        max_new = max(r.output_len for r in batch)
        left = deadline - 3 - time.time()
        if left <= 1:
            truncated = True
            break
        steps = _hf_generate(model, batch, max_new, gen_kw, device, torch, left)
        useful += sum(min(r.output_len, steps) for r in batch)
        generated += steps * len(batch)
        if steps < max_new:
            truncated = True
            break
        done_requests += len(batch)
    elapsed = time.perf_counter() - t0
    res["run"] = dict(
        num_requests=len(requests),
        num_requests_total=spec["num_requests_total"],
        subset="the first hf_num_requests requests of the same list, in request order",
        num_requests_finished=done_requests,
        batch_size=batch_size,
        complete=not truncated,
        truncated_by_time=truncated,
        elapsed_s=elapsed,
        num_output_tokens=useful,  # each request's own output length (or what was done)
        num_generated_tokens=generated,  # padding to each batch's longest included
        output_tokens_per_s=useful / elapsed if elapsed > 0 else None,
        mode="static batches, left padding, min_new_tokens = max_new_tokens = batch's longest",
    )
    if device == "cuda":
        res["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    res["status"] = "done" if not truncated else "run cut at the deadline"
    res.save()


def _hf_load(auto_cls, model_dir: str, dtype: str, device: str, torch, res: dict):
    """The checkpoint in ``dtype`` on ``device``: straight onto the GPU where this transformers
    can (device_map needs accelerate), else through host memory."""
    want = getattr(torch, dtype)
    res["load_path"] = "from_pretrained, then .to(device)"
    model = None
    if device != "cpu":
        try:
            model = auto_cls.from_pretrained(model_dir, dtype=want, device_map=device)
            res["load_path"] = "from_pretrained(device_map=device)"
        except (ImportError, ValueError) as e:  # no accelerate
            res["device_map_refused"] = f"{type(e).__name__}: {e}"[:300]
    if model is None:
        model = auto_cls.from_pretrained(model_dir, dtype=want)
    if model.dtype != want:  # a transformers that took dtype= for something else
        model = model.to(want)
    return model.to(device).eval()


def _hf_generate(model, batch, max_new: int, gen_kw: dict, device: str, torch, max_time) -> int:
    """Generate for one left-padded batch; returns the number of new tokens per row."""
    longest = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: the prompt ends at the last column
        ids[i, longest - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - r.prompt_len :] = 1
    extra = {} if max_time is None else {"max_time": float(max_time)}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            **gen_kw,
            **extra,
        )
    if device == "cuda":
        torch.cuda.synchronize()
    return int(out.shape[1] - longest)
