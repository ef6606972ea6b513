"""Compile the token-count kernels to sm_90 cubins without a GPU: Helion -> Triton source -> PTX -> cubin.

    python benchmarks/probes/codegen_check.py [--n 8192 --h 4096 --v 128256] [--dump DIR]

Needs triton importable (the GPU image's 3.6, or ``pip install --target DIR triton==3.6.0`` and DIR on
PYTHONPATH on a CPU machine; torch itself may be a CPU build). What it does: fakes an H200 (sm_90, 132 SMs) for
the device queries Helion makes, binds each kernel that takes the token count at run time (issue 60:
``lse_forward`` plain and storing, ``target_dot``, ``dz_gated``) on CPU tensors that Helion's compile
environment re-creates as CUDA fakes with symbolic sizes, generates the Triton code of the shipped H200 config
(``flce_dist/configs/helion/h200.json``) and compiles it with Triton's sm_90 backend (ptxas included). Prints per
kernel: whether N is symbolic in the code, the shared memory, the PTX line count. Run it on another tree
(``PYTHONPATH=.old``) to compare. A compile error here is one on the GPU; speed needs the GPU (``device.sh ab``).
Run 37 (no GPU lent): the four compiled; PTX lines 2224 -> 3239 (plain pass) and 2779 -> 3952 (storing pass)
against ae781b7's static-shape kernels: the epilogue's N and V bound masks (``tl.where`` before the row max and
sum), which a static N that divides the tile had let Helion drop.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import types

import torch

_PROPS = types.SimpleNamespace(
    multi_processor_count=132, major=9, minor=0, name="NVIDIA H200", total_memory=140 << 30,
    max_threads_per_multi_processor=2048, shared_memory_per_block_optin=232448, regs_per_multiprocessor=65536,
    warp_size=32, L2_cache_size=50 << 20, shared_memory_per_multiprocessor=233472, max_threads_per_block=1024,
    gcnArchName="", uuid="fake", is_integrated=False, shared_memory_per_block=49152)
# the kernels' parameter names -> Triton signature types (bf16 inputs); other run-time scalars are i32
_TYPES = {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "z_out": "*bf16", "dz": "*bf16", "target_local": "*i32",
          "ref": "*fp32", "w_perm": "*i32", "pmax": "*fp32", "psum": "*fp32", "ptgt": "*fp32", "psumy": "*fp32",
          "pent": "*fp32", "lse": "*fp32", "g": "*fp32", "gate": "*i32", "out": "*fp32", "scale": "fp32",
          "two_zl": "fp32", "softcap": "fp32"}


def _fake_h200() -> None:
    """Device queries answered as an H200; Helion's compile environment turns CPU inputs into CUDA fakes."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: _PROPS
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *a, **k: _PROPS.name
    import helion.runtime.kernel as hk
    from helion._compiler.compile_environment import CompileEnvironment

    orig = CompileEnvironment._to_fake_tensor

    def to_fake(self, tensor, source):
        if getattr(self, "device", None) is not None and self.device.type == "cpu":
            self.device = torch.device("cuda", 0)
        r = orig(self, tensor, source)
        if r.device.type != "cpu":
            return r
        del self.input_sources[r]
        c = torch.empty_strided(r.size(), r.stride(), dtype=r.dtype, device="cuda")  # symbolic sizes kept
        self.input_sources[c] = source
        return c

    CompileEnvironment._to_fake_tensor = to_fake
    hk._device_specialization_key = lambda args: ("cuda", (9, 0))


def _config(name: str, variant: str, h: int | None) -> tuple[dict, dict]:
    from flce_dist.kernels import launch as L

    table = L.load_configs("h200")
    keys = [f"{name}_{variant}"] if variant else []
    keys.append(name)
    for k in keys:
        for dc in ([f"bf16@h{h}"] if h else []) + ["bf16", "default"]:
            e = table.get(k, {}).get(dc)
            if e:
                return {**L.DEFAULTS[name]["block"], **e.get("block", {})}, e.get("config", {})
    return dict(L.DEFAULTS[name]["block"]), dict(L.DEFAULTS[name]["config"])


def check(name: str, variant: str, args: tuple, h: int, dump: str) -> dict:
    import helion
    import triton
    from triton.backends.compiler import GPUTarget

    from flce_dist.kernels import launch as L

    block, cfg = _config(name, variant, h if name == "lse_forward" else None)
    bound = L._kernels()[name].bind(args + tuple(block[k] for k in L.BLOCK_ORDER[name]))
    code = bound.to_triton_code(helion.Config(**cfg))
    code = code[code.index("from __future__"):]
    path = os.path.join(dump, f"{name}_{variant or 'plain'}.py")
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = next(getattr(mod, k) for k in dir(mod) if k.startswith("_helion_"))
    sig = {p.name: "constexpr" if p.is_constexpr else _TYPES.get(p.name, "fp32" if "LOG2E" in p.name else "i32")
           for p in fn.params}
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={p.name: _PROPS.multi_processor_count for p in fn.params if p.is_constexpr})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)})
    return {"kernel": name, "variant": variant or "plain", "symbolic_n": "x_size_0" in code or ", n," in code,
            "shared": k.metadata.shared, "ptx_lines": len(k.asm["ptx"].splitlines()), "config": cfg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--dump", default="", help="write the generated Triton sources here (default: a temp folder)")
    a = ap.parse_args()
    _fake_h200()
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    n, h, v = a.n, a.h, a.v

    def e(*s, dt=bf):
        return torch.empty(*s, dtype=dt)

    cases = [
        ("lse_forward", "", (e(n, h), e(v, h), e(1), e(n, dt=i32), e(1, 1), e(1, dt=f32), e(1, dt=i32), 1.0, 0.0,
                             False, 0, False, False, False, False)),
        ("lse_forward", "store", (e(n, h), e(v, h), e(1), e(n, dt=i32), e(n, v), e(1, dt=f32), e(1, dt=i32), 1.0, 0.0,
                                  False, 1, False, True, False, False)),
        ("target_dot", "", (e(n, h), e(v, h), e(n, dt=i32), 1.0, 0.0)),
        ("dz_gated", "", (e(n, h), e(v, h), e(n, v), e(n, dt=i32), e(n, dt=f32), e(n, dt=f32), e(1, dt=i32), 1.0, 0.0)),
    ]
    dump = a.dump or tempfile.mkdtemp(prefix="flce_codegen_")
    os.makedirs(dump, exist_ok=True)
    for name, variant, args in cases:
        r = check(name, variant, args, h, dump)
        print(f"{r['kernel']:12} {r['variant']:6} compiled  symbolic N={r['symbolic_n']}  shared={r['shared']}  "
              f"ptx_lines={r['ptx_lines']}  config={r['config']}")
    print(f"sources: {dump}")


if __name__ == "__main__":
    main()
