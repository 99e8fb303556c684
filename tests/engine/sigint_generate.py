"""Run by test_robustness.py in a subprocess: real SIGINTs at random moments of LLM.generate.

Each round starts a thread that sends SIGINT to this process after a random delay within one
generate's duration (every third round twice in quick succession: the second one stops a step
at once instead of at its end), then calls generate. After every round, interrupted or not, the
LLM must hold no request and no block; every generate that completes, and a final one, must
give the greedy tokens of an undisturbed run. Prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time

from jaxserve import LLM, SamplingParams


def _held(llm: LLM) -> bool:
    """Whether a request or a block is still held. (The runner learns of aborts at the next
    step, as in vLLM; the greedy comparisons check that it does.)"""
    stats = llm.get_stats()
    return (
        llm.engine.has_unfinished_requests()
        or llm.engine.scheduler.has_unfinished_requests()
        or stats["num_free_kv_blocks"] != stats["num_usable_kv_blocks"]
    )


def _raised_inside_step(e: BaseException) -> bool:
    """Whether the KeyboardInterrupt came from inside the engine's step (a second Ctrl-C
    stops it at once) rather than at a safe point."""
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_step" and code.co_filename.endswith("llm_engine.py"):
            return True
        tb = tb.tb_next
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=90.0)
    args = parser.parse_args()
    llm = LLM(
        "tiny-random-llama",
        num_kv_blocks=40,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=128,
        warmup=False,
    )
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    prompts = [
        shared + [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 40))] for _ in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    reference = tokens(llm.generate(prompts, params, use_tqdm=False))
    start = time.perf_counter()
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    duration = time.perf_counter() - start

    summary = dict(rounds=0, interrupted=0, interrupted_inside_step=0, mismatches=0, held_after=0)
    deadline = time.monotonic() + args.budget_s
    pid = os.getpid()
    for i in range(args.rounds):
        if time.monotonic() > deadline:
            break
        delay, gap = rng.uniform(0.0, duration), rng.uniform(0.0005, 0.005)
        double = i % 3 == 2

        go = threading.Event()

        def fire(delay=delay, gap=gap, double=double, go=go):
            go.wait()
            time.sleep(delay)
            os.kill(pid, signal.SIGINT)
            if double:
                time.sleep(gap)
                os.kill(pid, signal.SIGINT)

        sender = threading.Thread(target=fire)
        sender.start()  # (SIGINT is ignored until the sender is told to go)
        outs = caught = None
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            go.set()
            outs = llm.generate(prompts, params, use_tqdm=False)
        except KeyboardInterrupt as e:
            caught = e  # (nothing that can be interrupted until SIGINT is ignored below)
        while True:  # a SIGINT not yet handled may still raise here, once generate returned
            try:
                sender.join()
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                break
            except KeyboardInterrupt:
                continue
        if outs is not None:
            summary["mismatches"] += tokens(outs) != reference
        else:
            summary["interrupted"] += 1
            summary["interrupted_inside_step"] += _raised_inside_step(caught)
        summary["rounds"] += 1
        summary["held_after"] += _held(llm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    summary["mismatches"] += tokens(llm.generate(prompts, params, use_tqdm=False)) != reference
    summary["held_after"] += _held(llm)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
