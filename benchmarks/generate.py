"""Time per generated token: Hugging Face ``generate`` in ``predict_step`` on one device against the pipeline.

Run ``python benchmarks/generate.py`` (a few minutes; ``--layers``, ``--width``, ``--tokens``, ``--devices``). It builds
``GPT2LMHeadModel`` from a small configuration (random init, nothing downloaded) and, in one process and then pipelined
over ``p`` processes (gloo, one CPU thread each, ``PipelineParallelStrategy(schedule="1f1b")``), runs
``trainer.predict`` on ``--batches`` batches of 4 prompts of 16 tokens, each ``generate``-ing ``--tokens`` tokens
greedily with the key/value cache. Per batch, ``generate`` is timed inside ``predict_step`` on global rank 0 (host
clock: CPU); the first batch is left out (it decides how the step runs, see the README's "Generation"), and of the
others the fastest counts: on a machine shared with other work, the one least disturbed by it. Pipelined, each count of
processes runs twice: the current path (each stage's output sent to the next stage, the last one's to every rank, the
key/value cache of other stages' layers mirrored from their descriptions) and the old one
(``LIGHTNING_PP_EAGER=replay``: every block held elsewhere replayed on the meta device, every stage's output broadcast
in three collectives). Printed: the time per generated token, its ratio to one device's (the faster of its two runs),
and whether the tokens are one device's. Each pass through the blocks runs one stage after another: the ideal is one
device's time (no overlap is possible within one sequence's tokens), plus the transfers.

``--breakdown`` runs one device and 2 processes (current path) back to back, twice, clocking on every rank each block,
each message sent (from the stage's last block: composing and posting it) and each message received (waiting for its
bytes, then reading it: header, tensors, the cache layers mirrored), and prints, for the faster run of each, where a
token's time goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from _workers import answer_as_worker, run_workers  # beside this script


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One runner's rank (launched by ``main`` on ``spec["devices"]`` processes); global rank 0: the time per token and
    the tokens."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_pp import PipelineParallelStrategy

    torch.set_num_threads(1)

    class Generator(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(n_layer=spec["layers"], n_embd=spec["width"], n_head=4, vocab_size=512,
                                n_positions=16 + spec["tokens"])
            self.model = GPT2LMHeadModel(config)
            self.seconds: list[float] = []

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            start = time.perf_counter()
            tokens = self.model.generate(batch[0], max_new_tokens=spec["tokens"], do_sample=False, use_cache=True,
                                         pad_token_id=0)
            self.seconds.append(time.perf_counter() - start)
            return tokens

    clocks = _clocked() if spec.get("breakdown") else None
    L.seed_everything(0, verbose=False)
    module = Generator()
    prompts = torch.randint(1, 512, (4 * spec["batches"], 16), generator=torch.Generator().manual_seed(1))
    strategy: Any = "auto" if spec["devices"] == 1 else PipelineParallelStrategy(schedule="1f1b", microbatches=2)
    trainer = L.Trainer(accelerator="cpu", devices=spec["devices"], strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    outputs = trainer.predict(module, DataLoader(TensorDataset(prompts), batch_size=4))
    if not trainer.is_global_zero:
        return {}
    per_token = min(module.seconds[1:]) / spec["tokens"]
    result = {"ms_per_token": 1000 * per_token, "tokens": torch.cat(outputs).tolist()}  # type: ignore[arg-type]
    if clocks is not None:  # per token, over the batches after the first
        tokens = spec["tokens"] * (spec["batches"] - 1)
        result["clocks"] = {name: 1000 * seconds / tokens for name, seconds in clocks.items()}
        result["ms_per_token"] = 1000 * sum(module.seconds[1:]) / tokens
    return result


def _clocked() -> dict[str, float]:
    """Seconds spent, from the second ``predict_step`` on, in each GPT-2 block's forward, in `EagerLink.send` and
    `EagerLink.recv` and, within those, in waiting for a transfer (keys ``block``, ``send``, ``recv``, ``wait``)."""
    import functools

    from transformers.models.gpt2 import modeling_gpt2

    from lightning_pp.model import eager

    clocks = {"block": 0.0, "send": 0.0, "recv": 0.0, "wait": 0.0}
    counting = {"on": False}

    def clock(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if counting["on"]:
                    clocks[key] += time.perf_counter() - start

        setattr(owner, name, clocked)

    clock(modeling_gpt2.GPT2Block, "forward", "block")
    clock(eager.EagerLink, "send", "send")
    clock(eager.EagerLink, "recv", "recv")
    clock(eager.EagerLink, "_wait", "wait")
    original_generate = modeling_gpt2.GPT2LMHeadModel.generate
    batches = {"seen": 0}

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:  # the first batch is left out, as in the timing
        counting["on"] = batches["seen"] > 0
        batches["seen"] += 1
        try:
            return original_generate(self, *args, **kwargs)
        finally:
            counting["on"] = False

    setattr(modeling_gpt2.GPT2LMHeadModel, "generate", generate)  # noqa: B010 (a method replaced)
    return clocks


def _ping_pong(spec: dict[str, Any]) -> float | None:
    """A message to the other process and back, ``spec["trips"]`` times after as many to warm up; rank 0: the mean
    round trip in ms."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, trips = int(os.environ["RANK"]), spec["trips"]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    message = torch.zeros(1024)  # a token's activation for 4 prompts of width 256
    start = time.perf_counter()
    for trip in range(2 * trips):  # the first half warms up
        if trip == trips:
            start = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        else:
            dist.recv(message, 0)
            dist.send(message, 0)
    milliseconds = 1000 * (time.perf_counter() - start) / trips
    dist.destroy_process_group()
    return milliseconds if rank == 0 else None


def round_trip_ms(trips: int = 200) -> float:
    """A message's round trip between two processes over gloo now: two hand-offs, what a token through 2 stages adds
    to one device's time at least (the machine's load shows here first)."""
    return float(run_workers(__file__, 2, {"task": "ping_pong", "trips": trips}, timeout=300))


def worker(spec: dict[str, Any]) -> Any:
    """A launched process's part: ``spec["task"]`` (`run` or `_ping_pong`)."""
    return {"run": run, "ping_pong": _ping_pong}[spec["task"]](spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="pipelined process counts")
    parser.add_argument("--breakdown", action="store_true", help="where a token's time goes (see above)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    if args.breakdown:
        breakdown(args)
        return
    results: dict[tuple[int, str], Any] = {}
    # one device before the current path's runs and again after them (the faster counts), so that load from other
    # work on the machine while they ran does not flatter the ratios; the old path's runs last
    order = [(1, "-"), *((d, "current") for d in args.devices), (1, "again"), *((d, "old") for d in args.devices)]
    for devices, path in order:
        print(f"[{devices} process(es), {path} path] ...", file=sys.stderr, flush=True)
        spec = {"task": "run", "devices": devices, "layers": args.layers, "width": args.width, "tokens": args.tokens,
                "batches": args.batches}
        results[devices, path] = run_workers(__file__, devices, spec, timeout=900,
                                             env={"LIGHTNING_PP_EAGER": "replay"} if path == "old" else None)
    again = results.pop((1, "again"))
    base = results[1, "-"] = min(results[1, "-"], again, key=lambda result: result["ms_per_token"])
    assert again["tokens"] == base["tokens"]
    results = dict(sorted(results.items(), key=lambda item: (item[0][0], item[0][1] == "old")))
    trip = round_trip_ms()
    print(f"\nGPT-2 ({args.layers} layers of width {args.width}), {args.batches} batches of 4 prompts x 16 tokens (the "
          f"fastest but the first counts), {args.tokens} tokens each, greedy with the cache; CPU, gloo, one thread per "
          f"process. A gloo round trip between two processes took {trip:.2f} ms just after (the floor of 2 processes "
          f"is one device plus about that).\n")
    print("| processes | path | ms per generated token | vs one device | same tokens as one device |")
    print("|---|---|---|---|---|")
    for (devices, path), result in results.items():
        print(f"| {devices} | {path} | {result['ms_per_token']:.2f} | "
              f"{result['ms_per_token'] / base['ms_per_token']:.2f}x | {result['tokens'] == base['tokens']} |")


def breakdown(args: argparse.Namespace) -> None:
    """One device and 2 processes back to back, twice; the faster run of each, as a table of ms per token."""
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for devices in (1, 2, 1, 2):
        print(f"[{devices} process(es), clocked] ...", file=sys.stderr, flush=True)
        spec = {"task": "run", "devices": devices, "layers": args.layers, "width": args.width, "tokens": args.tokens,
                "batches": args.batches, "breakdown": True}
        runs[devices].append(run_workers(__file__, devices, spec, timeout=900))
    one, two = (min(runs[d], key=lambda result: result["ms_per_token"]) for d in (1, 2))
    assert one["tokens"] == two["tokens"]
    c1, c2 = one["clocks"], two["clocks"]  # rank 0's clocks; each token crosses 2 boundaries, one received here
    blocks = args.layers
    print(f"\nGPT-2 ({args.layers} layers of width {args.width}), {args.tokens} tokens per batch, ms per token (the "
          f"mean over batches 2-{args.batches}), the faster of two runs each; 2 processes: rank 0's clocks (stage 0, "
          f"half the blocks; the other stage's blocks are counted as rank 0 waits for them).\n")
    print("| | one device | 2 processes |")
    print("|---|---|---|")
    print(f"| a token | {one['ms_per_token']:.2f} | {two['ms_per_token']:.2f} "
          f"({two['ms_per_token'] / one['ms_per_token']:.2f}x) |")
    print(f"| one block (mean) | {c1['block'] / blocks:.3f} | {2 * c2['block'] / blocks:.3f} |")
    print(f"| the code around the blocks | {one['ms_per_token'] - c1['block']:.2f} | |")
    print(f"| sending a stage's output (composing, posting) | | {c2['send']:.3f} |")
    print(f"| reading a received output (all but the wait) | | {c2['recv'] - c2['wait']:.3f} |")
    print(f"| waiting: the other stage's blocks and messages, the transfers | | {c2['wait']:.2f} |")


if __name__ == "__main__":
    main()
