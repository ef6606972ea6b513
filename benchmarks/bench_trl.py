"""TRL GRPO with and without ``flce_dist.integrations.trl.patch()``: step time and peak memory.

Three levels, TRL's own path plain then patched in the same process (one GPU):

1. ``head``: TRL's fused-head function alone, ``_ChunkedLogProbFunction.apply(hidden [N, H], weight
   [V, H], None, targets, T, 32768, None, 1.0, ("log_probs", "entropy"))`` fwd+bwd (objective
   ``sum(a * log_probs) + 0.01 * sum(entropy)``) against ``flce_trl.chunked_logprob``; bf16 inputs.
2. ``model``: a Llama-3.2-1B-shaped ``LlamaForCausalLM`` (H=2048, 16 layers, V=128256, tied head)
   with ``trl.trainer.utils.add_fused_lm_head``: ``model(ids, labels=..., fused_lm_head=True)``
   fwd+bwd under bf16 autocast, fp32 weights, as GRPO's loss pass runs it, for ``B x T`` tokens.
3. ``trainer``: ``GRPOTrainer.train()`` on that model (random init, word-level tokenizer of V
   words, ``beta=0``, generation by ``model.generate``), ``--steps`` steps after one warm-up step:
   the whole step (generation included), the loss pass (``compute_loss``) and its backward timed
   with ``torch.cuda.synchronize``, and the step's peak allocated memory.

Times: CUDA events, median of ``--reps`` after warm-up (levels 1-2); level 3 per-step medians.
Writes ``trl_<level>.csv`` to ``benchmarks/results/`` and ``--out``; prints one table last.

    python benchmarks/bench_trl.py --levels head,model,trainer --out /tmp/out
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

import common  # noqa: F401  (puts the repository root on sys.path)
from flce_dist._timing import cuda_time_ms, write_csv
from flce_dist.integrations import trl as flce_trl

V, H = 128256, 2048


def _peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _modes():
    """("trl", "flce") in turn, patching around the second."""
    for mode in ("trl", "flce"):
        if mode == "flce":
            flce_trl.patch()
        try:
            yield mode
        finally:
            if mode == "flce":
                flce_trl.unpatch()


def bench_head(ns: list[int], reps: int) -> list[dict]:
    import trl.trainer.utils as tu

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in ns:
        x = (torch.randn(n, H, device="cuda", generator=g) * 1.0).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
        t = torch.randint(0, V, (n,), device="cuda", generator=g)
        a = torch.randn(n, device="cuda", generator=g)
        for mode in _modes():
            fn = tu._ChunkedLogProbFunction.apply if mode == "trl" else flce_trl.chunked_logprob

            def step():
                x.grad = w.grad = None
                lp, ent = fn(x, w, None, t, 0.9, 32768, None, 1.0, ("log_probs", "entropy"))[:2]
                ((a * lp).sum() + 0.01 * ent.sum()).backward()

            ms = cuda_time_ms(step, reps)
            peak = _peak_gib(step)
            rows.append(dict(level="head", mode=mode, n=n, h=H, v=V, ms=ms, peak_gib=peak))
            print(f"[head] N={n} {mode}: {ms:.2f} ms, peak {peak:.2f} GiB", flush=True)
        del x, w, t, a
    return rows


def _model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rope_theta=500000.0, tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    return LlamaForCausalLM(cfg).cuda()


def bench_model(shapes: list[tuple[int, int]], reps: int) -> list[dict]:
    import trl.trainer.utils as tu

    model = _model()
    tu.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for b, t in shapes:
        ids = torch.randint(3, V, (b, t), device="cuda", generator=g)
        labels = ids.clone()
        labels[:, : t // 8] = -100  # a prompt part, as GRPO masks it
        adv = torch.randn(b, t - 1, device="cuda", generator=g)
        for mode in _modes():
            def step():
                model.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
                ((adv * out.log_probs).sum() + 0.01 * out.entropy.sum()).backward()

            ms = cuda_time_ms(step, reps)
            peak = _peak_gib(step)
            rows.append(dict(level="model", mode=mode, n=b * t, b=b, t=t, h=H, v=V, ms=ms, peak_gib=peak))
            print(f"[model] B={b} T={t} {mode}: {ms:.2f} ms, peak {peak:.2f} GiB", flush=True)
    del model
    return rows


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _grpo(steps: int, batch: int, completion: int, tokenizer) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = _model()
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + j) % min(5000, V - 3)}" for j in range(32))
                                         for i in range(batch * (steps + 1))]})
    timing = {"step": [], "loss": [], "backward": [], "peak": []}
    marks = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            marks.update(t0=time.perf_counter(), loss=0.0, backward=0.0)

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            timing["step"].append(time.perf_counter() - marks["t0"])
            timing["loss"].append(marks["loss"])
            timing["backward"].append(marks["backward"])
            timing["peak"].append(torch.cuda.max_memory_allocated() / 2**30)

    def reward(completions, **kw):
        return [len(set(c.split())) / (1 + len(c.split())) for c in completions]

    on_gpu = torch.cuda.is_available()  # (a CPU run only checks this script: tests/test_benchmarks.py)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, beta=0.0, per_device_train_batch_size=batch, num_generations=batch // 2,
                          max_completion_length=completion, max_steps=steps + 1, learning_rate=1e-6,
                          temperature=0.9, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                          bf16=on_gpu, use_cpu=not on_gpu, dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Clock()])
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def timed(key, fn):
            def wrapper(*a, **k):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                r = fn(*a, **k)
                torch.cuda.synchronize()
                marks[key] += time.perf_counter() - t0
                return r
            return wrapper

        trainer.compute_loss = timed("loss", compute_loss)
        trainer.accelerator.backward = timed("backward", backward)
        trainer.train()
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    med = {k: statistics.median(v[1:]) for k, v in timing.items()}  # the first step warms up
    return dict(step_ms=1e3 * med["step"], loss_ms=1e3 * med["loss"], backward_ms=1e3 * med["backward"],
                peak_gib=max(timing["peak"][1:]))


def bench_trainer(steps: int, batch: int, completion: int) -> list[dict]:
    tok = _tokenizer()
    rows = []
    for mode in _modes():
        r = _grpo(steps, batch, completion, tok)
        rows.append(dict(level="trainer", mode=mode, batch=batch, completion=completion, steps=steps, h=H, v=V, **r))
        print(f"[trainer] {mode}: step {r['step_ms']:.0f} ms (loss pass {r['loss_ms']:.1f}, backward "
              f"{r['backward_ms']:.1f}), peak {r['peak_gib']:.2f} GiB", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="head,model,trainer")
    ap.add_argument("--ns", default="1024,2048,4096,8192", help="head level: token counts")
    ap.add_argument("--shapes", default="8x256,16x512,8x2048", help="model level: BxT list")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="trainer level: timed steps (after one warm-up)")
    ap.add_argument("--batch", type=int, default=16, help="trainer level: completions per step")
    ap.add_argument("--completion", type=int, default=256, help="trainer level: max completion tokens")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    levels = args.levels.split(",")
    rows = []
    if "head" in levels:
        rows += bench_head([int(n) for n in args.ns.split(",")], args.reps)
    if "model" in levels:
        rows += bench_model([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")], args.reps)
    if "trainer" in levels:
        rows += bench_trainer(args.steps, args.batch, args.completion)
    for level in levels:
        sel = [r for r in rows if r["level"] == level]
        if sel:
            write_csv(sel, f"trl_{level}.csv", [args.out] if args.out else [])
    print("\n=== TRL summary (TRL 1.16 fused head vs flce_dist patch; ratio = trl / flce)")
    key = {"head": "ms", "model": "ms", "trainer": "step_ms"}
    for i in range(0, len(rows) - 1, 2):
        a, b = rows[i], rows[i + 1]
        what = (f"N={a.get('n')}" if a["level"] == "head" else f"B={a.get('b')} T={a.get('t')}"
                if a["level"] == "model" else f"B={a.get('batch')} C={a.get('completion')}")
        k = key[a["level"]]
        extra = (f"  loss pass {a['loss_ms']:.1f}/{b['loss_ms']:.1f} ms, backward {a['backward_ms']:.1f}/"
                 f"{b['backward_ms']:.1f} ms" if a["level"] == "trainer" else "")
        print(f"{a['level']:8} {what:16} trl {a[k]:9.2f} ms  flce {b[k]:9.2f} ms  x{a[k] / b[k]:5.2f}  "
              f"peak {a['peak_gib']:6.2f} / {b['peak_gib']:6.2f} GiB{extra}")


if __name__ == "__main__":
    main()
