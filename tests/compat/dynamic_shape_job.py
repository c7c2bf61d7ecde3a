"""The torch 2.9 compat row's job (noxfile compat-torch2.9, LOONGKIT_DYNAMIC_SHAPE_FIX): a dynamic-shape training
probe. Each case resets dynamo (torch._dynamo.reset(), as a script compiling several models does), compiles a
small training step with `torch.compile(dynamic=True)` (inductor, CPU) and runs it on a sequence of inputs whose
sizes and layouts change (contiguous, a slice of a longer tensor, a transposed view), forward and backward, each
compared with eager (loss and input gradient within 1e-4).

On torch 2.9.x, compiles with dynamic shapes run symbolic shape guards compiled to C++
(torch._dynamo.config.enable_cpp_symbolic_shape_guards, on by default in 2.9.0), the mechanism the fix switches
off. The case that shows the upstream crash is `scaled/slice`: the step calls a module holding a float attribute
(`self.scale = 32 ** -0.5`, an attention-style scale). With dynamic shapes a float is not specialized in 2.9
(specialize_float=False), so the guard set reads it (its value feeds the C++ shape guard), and the module sits
under dynamo's recursive dict-tag check (use_recursive_dict_tags_for_guards): once the module's dicts are
unchanged, the guard walk skips the module's subtree, the C++ shape guard (which waits for all its inputs) does
not receive the float's value and rejects nothing, so its other relations go unchecked too, among them
`L['x'].stride()[0] == 32*L['x'].size()[1]`. The graph compiled for the first, contiguous (2, 5, 32) input then
gets the (2, 5, 32) slice of a (2, 6, 32) tensor and inductor's assert_size_stride raises
`AssertionError: expected size 2==2, stride 192==160 at dim=0` (stride 192 = 6*32 given, 160 = 5*32 expected).
With the Python shape guard (the fix) the slice fails the guard and dynamo recompiles; the other cases equal eager
either way. Prints one line per case and a last line
`dynamic-shape probe: N cases, C crashed, M differ from eager, K compiles; torch V`;
exit status 0 whatever the cases did (the session judges).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
import torch._dynamo
import torch.nn.functional as F

torch.manual_seed(0)
W = torch.randn(32, 16)
HEAD = torch.nn.Linear(32, 8)


class Scaled(torch.nn.Module):
    """A projection times a float attribute: the float (unspecialized on 2.9) puts this module in the shape guard."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 8)
        self.scale = 32 ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * self.scale).softmax(-1).pow(2).sum()


SCALED = Scaled()


def linear(x: torch.Tensor) -> torch.Tensor:
    return (x @ W).tanh().sum()


def module(x: torch.Tensor) -> torch.Tensor:
    return HEAD(x).relu().mean()


def flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).sin().sum()


def pad(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, (4 - x.shape[1] % 4) % 4)).cumsum(1).sum()


def scaled(x: torch.Tensor) -> torch.Tensor:
    return SCALED(x)


def layouts(n: int) -> dict[str, torch.Tensor]:
    return {"contiguous": torch.randn(2, n, 32), "slice": torch.randn(2, n + 1, 32)[:, :n],
            "transposed": torch.randn(2, 32, n).transpose(1, 2)}


SEQUENCES = {  # (size, layout) per call
    "grow": [(5, "contiguous"), (6, "contiguous"), (7, "contiguous")],
    "slice": [(5, "contiguous"), (6, "contiguous"), (5, "slice"), (5, "contiguous")],
    "mixed": [(5, "slice"), (6, "transposed"), (5, "contiguous"), (7, "slice")],
}
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": linear, "module": module, "flatten": flatten, "pad": pad, "scaled": scaled}


def run_case(fn: Callable[[torch.Tensor], torch.Tensor], calls: list[tuple[int, str]], compiles: list[int]) -> str:
    torch._dynamo.reset()

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        compiles[0] += 1
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    compiled = torch.compile(fn, dynamic=True, backend=counting)
    for n, layout in calls:
        x = layouts(n)[layout]
        xc = x.detach().requires_grad_(True)
        xe = x.detach().requires_grad_(True)
        try:
            loss = compiled(xc)
            loss.backward()
        except Exception as exc:  # the probe reports any failure of the compiled step
            lines = str(exc).strip().splitlines()
            errors = [x.strip() for x in lines if "error:" in x.lower()]  # a C++ compiler's own message
            line = (errors or lines or [""])[0]
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return f"CRASH at ({n}, {layout}): {type(exc).__name__}: {line[:160]} [{where.name}]"
        expected = fn(xe)
        expected.backward()
        if not (torch.allclose(loss, expected, rtol=1e-4, atol=1e-4)
                and torch.allclose(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)):
            return f"DIFFERS at ({n}, {layout}): loss {loss.item():.6g} vs eager {expected.item():.6g}"
    return "ok"


def main() -> None:
    results = []
    compiles = [0]
    for fname, fn in FUNCTIONS.items():
        for sname, calls in SEQUENCES.items():
            result = run_case(fn, calls, compiles)
            results.append(result)
            print(f"case {fname}/{sname}: {result}", flush=True)
    crashed = sum(r.startswith("CRASH") for r in results)
    differ = sum(r.startswith("DIFFERS") for r in results)
    print(f"dynamic-shape probe: {len(results)} cases, {crashed} crashed, {differ} differ from eager, "
          f"{compiles[0]} compiles; torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
