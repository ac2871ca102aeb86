"""Memory per GPU and predicted step time of Llama 3 8B / 70B / 405B for a P x D x T layout and a schedule.

Run ``python benchmarks/calculator.py --model llama3-70b --gpus 16 --pp 2 --dp 1 --tp 8 --schedule 1f1b
--microbatches 8 --seq 8192 --microbatch-size 1``, or ``--table`` for the preset rows next to torchtitan's published
numbers. Pure arithmetic and this project's simulator: no GPU, nothing downloaded (the shapes are Hugging Face
``LlamaConfig``s built from the published Llama 3 / 3.1 hyper-parameters; one decoder layer is built on the meta device
to count its parameters).

Assumptions (each configurable where a flag is named):

- Layout: P pipeline stages (``--stages-per-rank`` v per rank for interleaved 1F1B and ZB-V, default 2), D data-parallel
  replicas (``data_parallel_mode="fsdp"``), T tensor-parallel ranks. Layers are split as torchtitan splits them: the
  first stage gets L // S, the middle stages the remainder. T divides the block weights and, vocab-parallel as in
  Megatron and torchtitan, the embedding, the head and the logits; with T = 1 these are whole, as in lightning_pp.
- Bytes per parameter: bf16 weights (``--weight-bytes 2``) and grads (``--grad-bytes 2``), fp32 master copy and Adam
  moments (``--optimizer-bytes 12``). FSDP shards only the blocks over D; the embedding and head stay whole on the first
  and last stage. ``--fsdp step`` (lightning_pp today, ``sharding.py``): a stage's bf16 weights and grads stay gathered
  between the step's backwards, only the optimizer state is 1/D. ``--fsdp layer`` (torchtitan): weights, grads and
  optimizer state are 1/D, plus one gathered layer of weights and grads.
- Activations per layer per micro-batch (Korthikanti et al. 2022, sequence parallel over T): s b h (34 + 5 a s / h) / T
  bytes without recomputation, 34 s b h / T selective, 2 s b h / T full (``--recompute``), plus one layer's 34 s b h / T
  while it is recomputed (full) and the last stage's logits, s b V 6 / T (bf16 and the fp32 loss). Micro-batches in
  flight are read off the schedule's action lists: a stage holds one from its F to its B (or I).
- Time: forward FLOPs per layer per micro-batch 2 N_layer b s + 4 b s^2 h, over T, plus the head's 2 h V b s / T on the
  last stage; B = 2 F (I = W = F), full recomputation adds one F of the layers to B (to I); at ``--peak-tflops`` x
  ``--mfu`` per GPU. A send costs s b h 2 bytes over ``--link-gbs`` GB/s. The per-rank lists of ``build_schedule`` run
  through ``simulate`` with these costs. Not modelled: FSDP and TP collectives (assumed overlapped), the optimizer step.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from lightning_pp.schedule import build_schedule
from lightning_pp.schedule.actions import Action, ActionType, Schedule
from lightning_pp.schedule.simulate import simulate

GIB = 2**30
# Llama 3 / 3.1 (hidden, layers, heads, KV heads, intermediate); vocabulary 128256, embedding and head untied
MODELS = {"llama3-8b": (4096, 32, 32, 8, 14336), "llama3-70b": (8192, 80, 64, 8, 28672),
          "llama3-405b": (16384, 126, 128, 8, 53248)}
# torchtitan's published runs (H100 96 GB HBM2e at 500 W, 400 Gb/s RDMA per GPU; seq_len 8192 from its
# train_configs/llama3_{8b,70b,405b}.toml at commit 9dec370, the one benchmarked). From torchtitan b5bcd76,
# benchmarks/llama3_h100_202412_torchtitan.md: Table 1 (8B, 8 GPUs, FSDP, local batch 2, selective AC): 5,762 TPS/GPU,
# 82.4 GiB (eager bf16), 6,667 with torch.compile. Table 4 (70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC,
# compile + Float8): 829 TPS/GPU, 71.9 GiB. Table 5 (405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32, full AC,
# compile + Float8 + async TP): 1F1B 100 TPS/GPU, 82.5 GiB; interleaved 1F1B 128, 72.7 GiB (micro-batches not stated;
# torchtitan's default then was one per pipeline rank: 8 of 4). benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md:
# 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16, full AC, compile, bf16, vanilla TP: 597.3 TPS/GPU.
PRESETS: list[dict[str, object]] = [
    dict(model="llama3-8b", pp=1, dp=8, tp=1, schedule="1f1b", microbatches=1, microbatch_size=2,
         recompute="selective", published="5,762 (82.4 GiB); table 1, bf16 eager"),
    dict(model="llama3-70b", pp=2, dp=1, tp=8, schedule="1f1b", microbatches=8, microbatch_size=1,
         recompute="full", published="not published for 16 GPUs"),
    dict(model="llama3-70b", pp=1, dp=32, tp=8, schedule="1f1b", microbatches=1, microbatch_size=16,
         recompute="full", published="597 bf16 (asyncTP doc); 829 fp8 (71.9 GiB), table 4"),
    dict(model="llama3-405b", pp=8, dp=8, tp=8, schedule="1f1b", microbatches=8, microbatch_size=4,
         recompute="full", published="100 (82.5 GiB); table 5, fp8"),
    dict(model="llama3-405b", pp=8, dp=8, tp=8, schedule="interleaved_1f1b", microbatches=8, microbatch_size=4,
         recompute="full", published="128 (72.7 GiB); table 5, fp8"),
]


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    layer_params: int
    embed_params: int
    head_params: int  # with the final norm


@functools.cache
def llama_shape(name: str) -> Shape:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    hidden, layers, heads, kv_heads, intermediate = MODELS[name]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=128256,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        layer_params = sum(p.numel() for p in LlamaDecoderLayer(config, 0).parameters())
    vocab = config.vocab_size
    return Shape(hidden, layers, heads, vocab, layer_params, vocab * hidden, vocab * hidden + hidden)


def split_layers(layers: int, stages: int) -> list[int]:
    """torchtitan's default split: the first stage gets layers // stages, the middle stages one extra each in turn."""
    counts = [layers // stages] * stages
    for i in range(layers % stages):
        counts[1 + i % max(1, stages - 2)] += 1
    return counts


def estimate(shape: Shape, a: argparse.Namespace) -> dict[str, float]:
    """Worst rank's memory (bytes), the simulated step (s), bubble and throughput for the layout in ``a``."""
    p, d, t, b, s, h = a.pp, a.dp, a.tp, a.microbatch_size, a.seq, shape.hidden
    v = a.stages_per_rank or (2 if a.schedule in ("interleaved_1f1b", "zbv") else 1)
    schedule: Schedule = build_schedule(a.schedule, p, a.microbatches, stages_per_rank=v)
    last = schedule.num_stages - 1
    per_stage = split_layers(shape.layers, schedule.num_stages)
    outside = [(shape.embed_params if st == 0 else 0) + (shape.head_params if st == last else 0)
               for st in range(schedule.num_stages)]

    flops_per_s = a.peak_tflops * 1e12 * a.mfu
    layer_f = (2 * shape.layer_params * b * s + 4 * b * s * s * h) / t / flops_per_s
    head_f = 2 * h * shape.vocab * b * s / t / flops_per_s
    recompute = 1.0 if a.recompute == "full" else 0.0
    send = s * b * h * 2 / (a.link_gbs * 1e9)

    def cost(action: Action) -> float:
        layers_f = per_stage[action.stage] * layer_f
        f = layers_f + (head_f if action.stage == last else 0.0)
        return {ActionType.FORWARD: f, ActionType.BACKWARD: 2 * f + recompute * layers_f,
                ActionType.BACKWARD_INPUT: f + recompute * layers_f, ActionType.BACKWARD_WEIGHT: f,
                }.get(action.type, send if action.is_send else 0.0)

    timeline = simulate(schedule, cost)
    per_layer = {"none": s * b * h * (34 + 5 * shape.heads * s / h), "selective": 34 * s * b * h,
                 "full": 2 * s * b * h}[a.recompute] / t
    worst: dict[str, float] = {}
    for rank, actions in enumerate(schedule.actions):
        stages = [st for st, r in enumerate(schedule.stage_to_rank) if r == rank]
        blocks = sum(per_stage[st] for st in stages) * shape.layer_params / t
        whole = sum(outside[st] for st in stages) / t
        gathered = a.fsdp == "step" or d == 1
        one_layer = 0.0 if gathered else shape.layer_params / t
        weights = (blocks if gathered else blocks / d + one_layer) + whole
        grads = (blocks if gathered else blocks / d + one_layer) + whole
        held = dict.fromkeys(stages, 0)
        peak = 0.0
        for action in actions:
            if action.type is ActionType.FORWARD:
                held[action.stage] += 1
            elif action.type in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT):
                held[action.stage] -= 1
            peak = max(peak, sum(n * per_stage[st] * per_layer for st, n in held.items()))
        transient = (34 * s * b * h / t if a.recompute == "full" else 0.0) + (
            6 * s * b * shape.vocab / t if last in stages else 0.0)
        row = {"params": blocks / d + whole, "weights": weights * a.weight_bytes, "grads": grads * a.grad_bytes,
               "optimizer": (blocks / d + whole) * a.optimizer_bytes, "activations": peak + transient}
        row["total"] = row["weights"] + row["grads"] + row["optimizer"] + row["activations"]
        if row["total"] > worst.get("total", -1.0):
            worst = {**row, "rank": rank}
    step = timeline.makespan
    return {**worst, "step": step, "bubble": timeline.bubble_fraction(),
            "tokens": a.microbatches * b * s / (step * p * t), "v": v}


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-70b")
    parser.add_argument("--gpus", type=int, help="checked against pp x dp x tp (default: their product)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks P")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP) replicas D")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks T")
    parser.add_argument("--schedule", default="1f1b", help="a lightning_pp generator: gpipe, 1f1b, interleaved_1f1b, "
                        "zb_h1, zbv")
    parser.add_argument("--stages-per-rank", type=int, help="default 2 for interleaved_1f1b and zbv, else 1")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="full")
    parser.add_argument("--fsdp", choices=["step", "layer"], default="step",
                        help="step: weights and grads gathered for the step (lightning_pp); layer: one layer at a time")
    parser.add_argument("--weight-bytes", type=float, default=2.0)
    parser.add_argument("--grad-bytes", type=float, default=2.0)
    parser.add_argument("--optimizer-bytes", type=float, default=12.0, help="fp32 master + Adam m and v")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100 SXM)")
    parser.add_argument("--mfu", type=float, default=0.4, help="achieved share of the peak")
    parser.add_argument("--link-gbs", type=float, default=50.0, help="GB/s per GPU between pipeline stages")
    parser.add_argument("--table", action="store_true", help="the preset rows as a markdown table")
    args = parser.parse_args(argv)
    if not args.table and args.gpus is not None and args.gpus != args.pp * args.dp * args.tp:
        parser.error(f"--gpus {args.gpus} is not pp x dp x tp = {args.pp * args.dp * args.tp}")
    return args


def table(args: argparse.Namespace) -> str:
    lines = [f"Worst rank; bf16 weights and grads, fp32 master + Adam ({args.optimizer_bytes:g} B/param), FSDP mode "
             f"`{args.fsdp}`; {args.peak_tflops:g} TFLOP/s x {args.mfu:g} MFU per GPU, {args.link_gbs:g} GB/s "
             f"between stages; seq {args.seq}. GiB columns: weights / grads / optimizer / activations = total.", "",
             "| model | GPUs | P x D x T | schedule | m x b | recompute | params/GPU | GiB per GPU | step s | bubble "
             "| tok/s/GPU | torchtitan tok/s/GPU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset in PRESETS:
        row = argparse.Namespace(**{**vars(args), **preset, "stages_per_rank": None})
        r = estimate(llama_shape(row.model), row)
        v = f" (v={r['v']:.0f})" if r["v"] > 1 else ""
        gib = " / ".join(f"{r[k] / GIB:.1f}" for k in ("weights", "grads", "optimizer", "activations"))
        lines.append(f"| {row.model} | {row.pp * row.dp * row.tp} | {row.pp} x {row.dp} x {row.tp} | {row.schedule}"
                     f"{v} | {row.microbatches} x {row.microbatch_size} | "
                     f"{row.recompute} | {r['params'] / 1e9:.2f} B | {gib} = **{r['total'] / GIB:.1f}** | "
                     f"{r['step']:.2f} | {r['bubble']:.0%} | {r['tokens']:,.0f} | {preset['published']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = options(argv)
    if args.table:
        print(table(args))
        return
    shape = llama_shape(args.model)
    r = estimate(shape, args)
    print(f"{args.model}: {shape.layers} layers of {shape.layer_params / 1e9:.3f} B params, embedding "
          f"{shape.embed_params / 1e9:.3f} B, head {shape.head_params / 1e9:.3f} B")
    print(f"layout P={args.pp} x D={args.dp} x T={args.tp} ({args.pp * args.dp * args.tp} GPUs), {args.schedule} "
          f"(v={r['v']:.0f}), {args.microbatches} micro-batches of {args.microbatch_size} x {args.seq} tokens, "
          f"recompute {args.recompute}, FSDP {args.fsdp}")
    print(f"worst rank {r['rank']:.0f}: {r['params'] / 1e9:.2f} B params; GiB weights {r['weights'] / GIB:.1f}, grads "
          f"{r['grads'] / GIB:.1f}, optimizer {r['optimizer'] / GIB:.1f}, activations {r['activations'] / GIB:.1f}, "
          f"total {r['total'] / GIB:.1f}")
    print(f"predicted step {r['step']:.3f} s, bubble {r['bubble']:.1%}, {r['tokens']:,.0f} tokens/s per GPU")


if __name__ == "__main__":
    main()
