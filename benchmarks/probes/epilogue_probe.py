"""What each part of the store pass's epilogue costs, alone and inside the loss.

    python3 benchmarks/probes/epilogue_probe.py [--shapes llama3,gemma] [--parts 0,1,2,3,4,5] [--reps 10]
        [--data random,realistic] [--repeat 1] [--energy-calls 25]

The fused row-scale loss's store pass (``kernels/lse_forward.py`` with store == 2) ran 1.09-1.12x
its bare cuBLAS matmul in runs 18-19, the forward-only pass (no store) 1.04x. This probe replaces
that one kernel (``launch._kernels()["lse_forward"]``, same arguments, same shipped config) by a
probe kernel whose epilogue keeps only some of the work, and times it (a) alone on one fused chunk
(``launch.lse_forward`` as the loss calls it: kernel + merge), (b) inside the whole fused fwd+bwd
at N = 8192, steady back to back, against the bare cuBLAS matmul of the same run:

    part 0  the chunk's bf16 logits stored, nothing else (a Helion matmul + store)
    part 1  + exp(y - r) stored instead (r: the row-scale reference), no reduction
    part 2  + the row sum of exp(y - r) (the statistics against r instead of the tile max)
    part 3  + the row max (kept: the accuracy and the form's gate need it), no target
    part 4  + the target logit (the per-element index compare): everything the loss needs,
            with exp taken against r (one fewer multiply per element than part 5)
    part 5  the shipped epilogue: exp against the tile max, times exp(m - r) per row
    part 6  part 5's statistics without the store (the loss then reads the buffer's stale E)
    part 7  part 5 with the target compare only in tiles that hold some row's target (a branch
            per tile on the row tile's targets: ~1/4 of the tiles at random targets, fewer at gemma)
    part 8  part 7 without the kernel's own ``where(valid, y, -inf)`` (Helion masks the reductions
            over a ragged last tile itself, and drops the masks where the tile divides V)
    part 9  part 5 without the target compare; the target logits from their own small launch
            (``kernels/target_dot.py``: each row's dot with its gathered target row, the pass's K
            blocks and order). Exact only if those bits equal the pass's: the probe counts the rows
            that do (run 20: all; shipped since 24bd433)

Since 24bd433 ``launch.lse_forward`` on sm_90 runs the pass without its target compare
(``with_tgt`` False) and takes the target logits from ``kernels/target_dot.py``: the "shipped kernel"
row is that path, and every part (which ignores ``store`` and ``with_tgt``) is followed by that launch
too (~0.02 ms per chunk; part 9's own
target_dot then runs twice). Parts 0-3 write partials that keep the loss finite and the row-scale gate closed (pmax = r), so the
loss's other kernels do the same work as with the shipped one; their loss values are wrong, only
their times are read. Parts 4 and 5 give the loss's own statistics (4: unless exp(y - r) overflows,
which a real change would have to catch). The floor is printed two ways: 3 x the bare ``x @ W.T``
(what the README's ratios use) and the layer's three distinct matmuls run back to back
(``x @ W.T``, ``dy @ W``, ``dy.T @ x``: ``_timing.three_matmuls``). Where NVML can be read
(``_timing.energy_j``), each loss and the three distinct matmuls also get joules per run: both loops
run at the board's power cap, where a variant's cost is its energy (a kernel can be faster alone and
still cost the loss time, as runs 11-19 saw four times).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import common  # noqa: E402,I001  (first: puts the repository's flce_dist on the path where none is)

import helion
import helion.language as hl
import torch

import flce_dist
from flce_dist import rowscale
from flce_dist._timing import cuda_steady_ms, energy_j, three_matmuls
from flce_dist.kernels import launch
from flce_dist.kernels.common import LOG2E, SETTINGS
from flce_dist.settings import current

from ab_flce import case_inputs  # noqa: E402

NAMES = {0: "store logits", 1: "+ exp(y-r)", 2: "+ sum", 3: "+ max", 4: "+ target (ref)", 5: "shipped epilogue", 6: "shipped, no store", 7: "shipped, target per tile", 8: "7 without the valid mask", 9: "5, target by its own dot"}


@helion.kernel(static_shapes=True, dot_precision="ieee", **SETTINGS)
def probe_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    target_local: torch.Tensor,
    z_out: torch.Tensor,
    ref: torch.Tensor,
    scale: float,
    softcap: hl.constexpr,
    has_bias: hl.constexpr,
    store: hl.constexpr,
    with_sum: hl.constexpr,
    with_ent: hl.constexpr,
    with_tgt: hl.constexpr,
    block_n: hl.constexpr,
    block_v: hl.constexpr,
    block_h: hl.constexpr,
    part: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    n_vt = (v + block_v - 1) // block_v
    pmax = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)
    psum = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)
    ptgt = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)
    psumy = torch.empty([n_vt, n], dtype=torch.float32, device=x.device)  # part 3/4: the max goes here
    pent = torch.empty([1, n], dtype=torch.float32, device=x.device)
    for tile_v, tile_n in hl.tile([v, n], block_size=[block_v, block_n]):
        acc = hl.zeros([tile_n, tile_v], dtype=torch.float32)
        for tile_h in hl.tile(h, block_size=block_h):
            acc = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=acc)
        zq = acc.to(x.dtype)
        r = ref[tile_n]
        if part == 0:
            z_out[tile_n, tile_v] = zq
            pmax[tile_v.id, tile_n] = r
            psum[tile_v.id, tile_n] = r * 0.0 + 1.0
            ptgt[tile_v.id, tile_n] = r * 0.0
        if part == 1:
            y1 = zq.to(torch.float32) * scale
            e1 = torch.exp2(y1 * LOG2E - (r * LOG2E)[:, None])
            z_out[tile_n, tile_v] = e1.to(z_out.dtype)
            pmax[tile_v.id, tile_n] = r
            psum[tile_v.id, tile_n] = r * 0.0 + 1.0
            ptgt[tile_v.id, tile_n] = r * 0.0
        if part == 2:
            y2 = zq.to(torch.float32) * scale
            valid2 = (tile_v.index < v)[None, :]
            e2 = torch.where(valid2, torch.exp2(y2 * LOG2E - (r * LOG2E)[:, None]), 0.0)
            z_out[tile_n, tile_v] = e2.to(z_out.dtype)
            pmax[tile_v.id, tile_n] = r
            psum[tile_v.id, tile_n] = torch.sum(e2, dim=1)
            ptgt[tile_v.id, tile_n] = r * 0.0
        if part == 3:
            y3 = zq.to(torch.float32) * scale
            valid3 = (tile_v.index < v)[None, :]
            ym3 = torch.where(valid3, y3, float("-inf"))
            e3 = torch.exp2(ym3 * LOG2E - (r * LOG2E)[:, None])
            z_out[tile_n, tile_v] = e3.to(z_out.dtype)
            pmax[tile_v.id, tile_n] = r
            psum[tile_v.id, tile_n] = torch.sum(e3, dim=1)
            ptgt[tile_v.id, tile_n] = r * 0.0
            psumy[tile_v.id, tile_n] = torch.amax(ym3, dim=1)
        if part == 4:
            y4 = zq.to(torch.float32) * scale
            valid4 = (tile_v.index < v)[None, :]
            ym4 = torch.where(valid4, y4, float("-inf"))
            e4 = torch.exp2(ym4 * LOG2E - (r * LOG2E)[:, None])
            z_out[tile_n, tile_v] = e4.to(z_out.dtype)
            hit4 = tile_v.index[None, :] == target_local[tile_n][:, None]
            pmax[tile_v.id, tile_n] = r
            psum[tile_v.id, tile_n] = torch.sum(e4, dim=1)
            ptgt[tile_v.id, tile_n] = torch.sum(torch.where(hit4, y4, 0.0), dim=1)
            psumy[tile_v.id, tile_n] = torch.amax(ym4, dim=1)
        if part == 5:
            y5 = zq.to(torch.float32) * scale
            valid5 = (tile_v.index < v)[None, :]
            ym5 = torch.where(valid5, y5, float("-inf"))
            m5 = torch.amax(ym5, dim=1)
            m_ref = torch.where(m5 > float("-inf"), m5, 0.0)
            e5 = torch.exp2(ym5 * LOG2E - (m_ref * LOG2E)[:, None])
            hit5 = tile_v.index[None, :] == target_local[tile_n][:, None]
            pmax[tile_v.id, tile_n] = m5
            psum[tile_v.id, tile_n] = torch.sum(e5, dim=1)
            ptgt[tile_v.id, tile_n] = torch.sum(torch.where(hit5, y5, 0.0), dim=1)
            f5 = torch.exp2((m_ref - r) * LOG2E)
            z_out[tile_n, tile_v] = (e5 * f5[:, None]).to(z_out.dtype)
        if part == 6:
            y6 = zq.to(torch.float32) * scale
            valid6 = (tile_v.index < v)[None, :]
            ym6 = torch.where(valid6, y6, float("-inf"))
            m6 = torch.amax(ym6, dim=1)
            m6_ref = torch.where(m6 > float("-inf"), m6, 0.0)
            e6 = torch.exp2(ym6 * LOG2E - (m6_ref * LOG2E)[:, None])
            hit6 = tile_v.index[None, :] == target_local[tile_n][:, None]
            pmax[tile_v.id, tile_n] = m6
            psum[tile_v.id, tile_n] = torch.sum(e6, dim=1)
            ptgt[tile_v.id, tile_n] = torch.sum(torch.where(hit6, y6, 0.0), dim=1)
        if part == 7:
            y7 = zq.to(torch.float32) * scale
            valid7 = (tile_v.index < v)[None, :]
            ym7 = torch.where(valid7, y7, float("-inf"))
            m7 = torch.amax(ym7, dim=1)
            m7_ref = torch.where(m7 > float("-inf"), m7, 0.0)
            e7 = torch.exp2(ym7 * LOG2E - (m7_ref * LOG2E)[:, None])
            pmax[tile_v.id, tile_n] = m7
            psum[tile_v.id, tile_n] = torch.sum(e7, dim=1)
            t7 = target_local[tile_n]
            inside = (t7 >= tile_v.begin) & (t7 < tile_v.end)
            if torch.amax(inside.to(torch.int32)) > 0:  # a tile holding some row's target: ~1/4 of them
                hit7 = tile_v.index[None, :] == t7[:, None]
                ptgt[tile_v.id, tile_n] = torch.sum(torch.where(hit7, y7, 0.0), dim=1)
            else:
                ptgt[tile_v.id, tile_n] = m7 * 0.0
            f7 = torch.exp2((m7_ref - r) * LOG2E)
            z_out[tile_n, tile_v] = (e7 * f7[:, None]).to(z_out.dtype)
        if part == 8:
            y8 = zq.to(torch.float32) * scale
            m8 = torch.amax(y8, dim=1)  # Helion masks the reductions of a ragged last tile itself
            m8_ref = torch.where(m8 > float("-inf"), m8, 0.0)
            e8 = torch.exp2(y8 * LOG2E - (m8_ref * LOG2E)[:, None])
            pmax[tile_v.id, tile_n] = m8
            psum[tile_v.id, tile_n] = torch.sum(e8, dim=1)
            t8 = target_local[tile_n]
            inside8 = (t8 >= tile_v.begin) & (t8 < tile_v.end)
            if torch.amax(inside8.to(torch.int32)) > 0:
                hit8 = tile_v.index[None, :] == t8[:, None]
                ptgt[tile_v.id, tile_n] = torch.sum(torch.where(hit8, y8, 0.0), dim=1)
            else:
                ptgt[tile_v.id, tile_n] = m8 * 0.0
            f8 = torch.exp2((m8_ref - r) * LOG2E)
            z_out[tile_n, tile_v] = (e8 * f8[:, None]).to(z_out.dtype)
        if part == 9:
            y9 = zq.to(torch.float32) * scale
            valid9 = (tile_v.index < v)[None, :]
            ym9 = torch.where(valid9, y9, float("-inf"))
            m9 = torch.amax(ym9, dim=1)
            m9_ref = torch.where(m9 > float("-inf"), m9, 0.0)
            e9 = torch.exp2(ym9 * LOG2E - (m9_ref * LOG2E)[:, None])
            pmax[tile_v.id, tile_n] = m9
            psum[tile_v.id, tile_n] = torch.sum(e9, dim=1)
            f9 = torch.exp2((m9_ref - r) * LOG2E)
            z_out[tile_n, tile_v] = (e9 * f9[:, None]).to(z_out.dtype)
    return pmax, psum, ptgt, psumy, pent


def target_rows_dot(x: torch.Tensor, w: torch.Tensor, tl: torch.Tensor, scale: float, block_h: int = 64,
                    block_n: int = 128) -> torch.Tensor:
    """[1, N] target logits from ``kernels/target_dot.py`` (shipped since 24bd433; part 9 came first)
    with the given blocks, through the launcher (never autotuned)."""
    return launch._launch("target_dot", (x, w, tl, float(scale), 0.0), x.device, x.dtype, current(),
                          blocks={"block_h": block_h, "block_n": block_n})


def _old(full: tuple) -> tuple:
    """The shipped kernel's arguments without ``w_perm`` (index 6) and ``permute_w`` (index 14), which
    ``lse_forward_partials`` gained after this probe (the filter's gather order): ``probe_partials``' own."""
    assert not full[14], "epilogue_probe: the gather order (permute_w) is not probed"
    return (*full[:6], *full[7:14], *full[15:])


class _Variant:
    """Stands in for the shipped kernel in ``launch._kernels()``: binds ``probe_partials`` with one
    more constexpr (``part``) after the shipped arguments."""

    def __init__(self, part: int) -> None:
        self.part = part
        self._bound: dict[int, _Bound] = {}

    def bind(self, full: tuple) -> "_Bound":
        b = probe_partials.bind((*_old(full), self.part))
        return self._bound.setdefault(id(b), _Bound(b, self.part))


class _Bound:
    def __init__(self, b, part: int) -> None:
        self.b, self.part = b, part

    def set_config(self, cfg) -> None:
        self.b.set_config(cfg)

    def __call__(self, *full):
        full = _old(full)
        out = self.b(*full, self.part)
        if self.part == 9:  # the target logits from their own launch: a one-row ptgt (launch.merge sums it)
            x, w, _, tl, *_rest = full
            out = (out[0], out[1], target_rows_dot(x, w, tl, full[6], full[15]), out[3], out[4])
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_case_args(ap, shapes="llama3,gemma", out=False)
    ap.add_argument("--parts", default="0,1,2,3,4,5,6")
    ap.add_argument("--repeat", type=int, default=1, help="time the variants' loss this many times, in turn")
    ap.add_argument("--energy-calls", type=int, default=25, help="back-to-back calls per NVML energy reading "
                    "(~1 s of work; 0: no energy columns)")
    a = ap.parse_args()
    common.check_case_args(ap, a)
    kernels = launch._kernels()
    shipped = kernels["lse_forward"]
    s = current()
    rows = []
    for shape, mode, h, v in common.cases(a):
        x, w, t = case_inputs(a.n, h, v, mode, a.sorted_vocab, a.fixture)  # random: ab_flce.py's inputs
        name = f"{shape}/{mode}"
        rows_c = common.chunk_plan(x, v)  # the loss's own chunk
        xc, tc = x.detach()[:rows_c], t[:rows_c].to(torch.int32)
        zc = torch.empty(rows_c, v, device="cuda", dtype=torch.bfloat16)
        rc = rowscale.reference(xc, w.detach(), 1.0)
        mm = cuda_steady_ms(lambda: x.detach() @ w.detach().T, a.reps)
        floor3 = three_matmuls(x.detach(), w.detach())
        mm3 = cuda_steady_ms(floor3, a.reps)
        e3 = energy_j(floor3, a.energy_calls) if a.energy_calls else None  # (J, ms, W) per call, or None
        del floor3
        mmc = cuda_steady_ms(lambda: torch.mm(xc, w.detach().T, out=zc), a.reps)
        print(f"{name}: bare matmul {mm:.2f} ms (x3 {3 * mm:.2f}), three distinct matmuls {mm3:.2f} ms; "
              f"chunk [{rows_c}, {v}] matmul {mmc:.3f} ms" + (f"; three distinct matmuls {e3[0]:.2f} J per run at "
                                                              f"{e3[2]:.0f} W" if e3 else ""), flush=True)
        if 9 in map(int, a.parts.split(",")):  # do target_dot's bits match the shipped pass's target logits?
            st_ship = launch.lse_forward(xc, w.detach(), None, tc, 1.0, 0.0, False, s, z_out=zc, exp_ref=rc)
            yt = target_rows_dot(xc, w.detach(), tc, 1.0, launch.entry("lse_forward", xc.device, xc.dtype, "store", h,
                                                                        s)["block"]["block_h"])[0]
            same = int((yt == st_ship[:, 1]).sum())
            diff = (yt - st_ship[:, 1]).abs().max().item()
            print(f"  target_dot vs the shipped pass: {same} of {rows_c} target logits bit-identical, max |diff| {diff:.3e}",
                  flush=True)
        for part in [-1, *map(int, a.parts.split(","))] * a.repeat:
            kernels["lse_forward"] = shipped if part < 0 else _Variant(part)
            label = "shipped kernel" if part < 0 else f"part {part}: {NAMES[part]}"
            try:
                one = cuda_steady_ms(lambda: launch.lse_forward(xc, w.detach(), None, tc, 1.0, 0.0, False, s,
                                                                z_out=zc, exp_ref=rc), a.reps)

                step = common.fwd_bwd(lambda: flce_dist.fused_linear_cross_entropy(x, w, t), x, w)
                fb = cuda_steady_ms(step, a.reps)
                ej = energy_j(step, a.energy_calls) if e3 else None
            except Exception as e:  # noqa: BLE001
                print(f"  {label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            finally:
                kernels["lse_forward"] = shipped
            jr = ej[0] / e3[0] if ej else float("nan")  # the loss's energy over the three distinct matmuls'
            rows.append((name, label, one, one / mmc, fb, fb / (3 * mm), fb / mm3, ej[0] if ej else float("nan"), jr))
            print(f"  {label:28} chunk {one:7.3f} ms ({one / mmc:.3f}x)  loss {fb:7.2f} ms "
                  f"({fb / (3 * mm):.3f}x 3mm, {fb / mm3:.3f}x 3 distinct)"
                  + (f"  {ej[0]:.2f} J ({jr:.3f}x the distinct matmuls') at {ej[2]:.0f} W" if ej else ""), flush=True)
        del x, w, t, zc
        torch.cuda.empty_cache()
    print("\n=== epilogue_probe summary (chunk: kernel + merge vs the chunk's cuBLAS matmul; loss: fwd+bwd)")
    print(f"{'case':16} {'variant':28} {'chunk ms':>9} {'x mm':>6} {'loss ms':>8} {'x3mm':>6} {'x3dist':>7}"
          f" {'loss J':>7} {'xJ3dist':>8}")
    for r in rows:
        print(f"{r[0]:16} {r[1]:28} {r[2]:9.3f} {r[3]:6.3f} {r[4]:8.2f} {r[5]:6.3f} {r[6]:7.3f} {r[7]:7.2f} {r[8]:8.3f}")


if __name__ == "__main__":
    main()
