"""Training step with and without the compile features, on CPU: mmdet ResNet backbone and a tiny Llama.

Each case runs twice in fresh interpreters under the loongkit prelude, in the same run: baseline with
the feature's variable =0 (eager, what upstream does) and ours with =1 (LOONGKIT_COMPILE_RESNET /
LOONGKIT_OPENVLA). A step is forward, a loss, backward and an SGD step. The first step carries the
one-time compile; the steady step time is the median of the following steps.

    python benchmarks/compile.py [--quick]      # ResNet needs mmdet: run it with the mm stack venv

Prints per case::

    BENCH <case>_step        baseline=<s> ours=<s> ratio=<baseline/ours>      (steady step)
    BENCH <case>_first_step  baseline=<s> ours=<s> ratio=...                  (includes compiling)
    BENCH <case>_peak_rss    baseline=<bytes> ours=<bytes> ratio=...          (process peak RSS)

and the Summary's compile_seconds / extra_memory_mb of the compiled run. Cases whose package is
missing print a SKIP line. --quick uses smaller models (under a minute once inductor's cache under
/tmp/torchinductor_<user> is warm; a first-ever run compiles cold and takes a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from _timing import bench_line

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    case, quick, steps = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    torch.manual_seed(0)
    if case == "resnet":
        import mmdet.models
        from mmdet.registry import MODELS
        if quick:
            net = MODELS.build(dict(type="ResNet", depth=18, num_stages=2, out_indices=(0, 1),
                                    strides=(1, 2), dilations=(1, 1)))
            x = torch.randn(2, 3, 64, 64)
        else:
            net = MODELS.build(dict(type="ResNet", depth=50, frozen_stages=1, norm_eval=True))
            x = torch.randn(2, 3, 128, 128)
        net.train()
        loss_fn = lambda: sum(o.float().mean() for o in net(x))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        h, layers, seq = (64, 2, 32) if quick else (256, 4, 128)
        cfg = LlamaConfig(vocab_size=512, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
        net = LlamaForCausalLM(cfg)
        ids = torch.randint(0, 512, (2, seq))
        loss_fn = lambda: net(input_ids=ids, labels=ids).loss
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"times": times, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
""")

CASES = {"resnet": ("LOONGKIT_COMPILE_RESNET", "compile_resnet", "mmdet"),
         "llama": ("LOONGKIT_OPENVLA", "openvla", "transformers")}


def prelude_path() -> str:
    from loongkit_core.prelude import PATH

    return PATH


def run(case: str, on: bool, quick: bool, steps: int) -> tuple[dict, dict | None]:
    var, feature, _ = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        summary = os.path.join(tmp, "summary.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOONGKIT_")}
        env.update({var: "1" if on else "0", "LOONGKIT_SUMMARY_JSON": summary, "LOONGKIT_LOGDIR": tmp,
                    "PYTHONPATH": os.pathsep.join(p for p in (prelude_path(), env.get("PYTHONPATH")) if p)})
        proc = subprocess.run([sys.executable, "-c", CHILD, case, "1" if quick else "0", str(steps)],
                              env=env, capture_output=True, text=True, timeout=1200)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{case} ({var}={int(on)}) failed:\n{proc.stderr[-3000:]}")
        row = None
        if os.path.exists(summary):
            with open(summary) as fh:
                row = next((r for r in json.load(fh)["features"] if r["name"] == feature), None)
        return json.loads(lines[-1][len("RESULT "):]), row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    args = parser.parse_args()
    steps = 6 if args.quick else 12
    import importlib.util

    for case, (_, feature, package) in CASES.items():
        if importlib.util.find_spec(package) is None:
            print(f"SKIP compile_{case}: {package} is not importable here", flush=True)
            continue
        base, _ = run(case, False, args.quick, steps)
        ours, row = run(case, True, args.quick, steps)
        label = f"compile_{case}{'_quick' if args.quick else ''}"
        bench_line(f"{label}_step", statistics.median(base["times"][2:]), statistics.median(ours["times"][2:]), 5)
        bench_line(f"{label}_first_step", base["times"][0], ours["times"][0], 5)
        bench_line(f"{label}_peak_rss", base["maxrss"], ours["maxrss"], 0)
        cfg = (row or {}).get("config") or {}
        print(f"  {feature}: state={(row or {}).get('state')} compiles={cfg.get('compiles')} "
              f"compile_seconds={cfg.get('compile_seconds')} extra_memory_mb={cfg.get('extra_memory_mb')} "
              f"fallback={cfg.get('fallback')}", flush=True)


if __name__ == "__main__":
    main()
