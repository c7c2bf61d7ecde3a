"""A lerobot pi0 training job on the published code (lerobot from the registry), tiny and without weights.

Run under loongkit (``loongkit-run python lerobot_pi0_job.py OUT.json`` with LOONGKIT_COMPILE_PI0PYTORCH=1) by
tests/published/test_lerobot_pi0.py. It trains ``lerobot.policies.pi0.modeling_pi0.PI0Policy`` the way
lerobot's training script does (``loss, _ = policy.forward(batch)``, backward, gradient clipping, AdamW
with the policy's optimizer preset), side by side with an eager deep copy of the same policy (copies are
never compiled), and writes both sides' losses and first gradients to OUT.json.

Two things stand in for what the registry cannot give:
- Sizes. pi0's variants are gemma_2b + gemma_300m (3 B parameters); ``get_gemma_config`` is replaced by
  two 2-layer Gemmas with pi0's head layout (8 query heads, 1 key/value head: lerobot hard-codes 8), and
  the SigLIP tower of ``CONFIG_MAPPING["paligemma"]()`` by one 32-wide layer on 28x28 images. lerobot sets
  the image projection to 2048 (gemma_2b's width): it is set to the tiny text width before the build.
- The transformers fork. lerobot's pi0 refuses a stock transformers (``transformers.models.siglip.check``)
  and calls the fork's adaRMS interface: ``GemmaRMSNorm(x, cond=...)`` returning ``(normed, gate)`` and
  ``modeling_gemma._gated_residual``. pi0 runs without adaRMS (``use_adarms=[False, False]``), where the
  fork's norm is the stock norm with gate None and the gated residual is the plain residual: that is
  what is installed here, and a ``cond`` other than None is refused.
"""

from __future__ import annotations

import copy
import json
import sys
import types
from typing import Any

import torch

STEPS = 3
BATCH = 2


def install_fork_interface() -> None:
    from transformers.models.gemma import modeling_gemma

    norm = modeling_gemma.GemmaRMSNorm
    stock = norm.forward
    plain = object()

    def forward(self: Any, x: torch.Tensor, cond: Any = plain) -> Any:
        if cond is plain:  # stock callers (GemmaModel) keep the stock return value
            return stock(self, x)
        if cond is not None:
            raise NotImplementedError("adaRMS conditioning is not part of this stand-in")
        return stock(self, x), None

    norm.forward = forward

    def gated_residual(x: torch.Tensor | None, y: torch.Tensor | None, gate: torch.Tensor | None) -> Any:
        if x is None or y is None:
            return x if y is None else y
        return x + y if gate is None else x + y * gate

    modeling_gemma._gated_residual = gated_residual
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True  # type: ignore[attr-defined]
    sys.modules[check.__name__] = check


def shrink(modeling_pi0: Any) -> None:
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    text = modeling_pi0.GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8)
    expert = modeling_pi0.GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=8)
    modeling_pi0.get_gemma_config = lambda variant: {"gemma_2b": text, "gemma_300m": expert}[variant]

    def paligemma() -> Any:
        vision = SiglipVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                                    image_size=28, intermediate_size=64)
        return PaliGemmaConfig(vision_config=vision)

    build = modeling_pi0.PaliGemmaForConditionalGeneration

    def paligemma_model(config: Any) -> Any:
        config.vision_config.projection_dim = config.text_config.hidden_size  # lerobot wrote gemma_2b's 2048
        return build(config=config)

    modeling_pi0.PaliGemmaForConditionalGeneration = paligemma_model
    modeling_pi0.CONFIG_MAPPING = {"paligemma": paligemma, "gemma": GemmaConfig}


def batch(step: int, config: Any) -> dict[str, torch.Tensor]:
    from lerobot.utils.constants import ACTION, OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE

    g = torch.Generator().manual_seed(1000 + step)
    tokens = 6
    return {
        "observation.images.top": torch.rand(BATCH, 3, 28, 28, generator=g),
        OBS_STATE: torch.randn(BATCH, 6, generator=g),
        ACTION: torch.randn(BATCH, config.chunk_size, 6, generator=g),
        OBS_LANGUAGE_TOKENS: torch.randint(0, 1000, (BATCH, tokens), generator=g),
        OBS_LANGUAGE_ATTENTION_MASK: torch.ones(BATCH, tokens, dtype=torch.bool),
    }


def main(out: str) -> None:
    install_fork_interface()
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi0.configuration_pi0 import PI0Config

    shrink(modeling_pi0)
    config = PI0Config(
        device="cpu", chunk_size=4, n_action_steps=4, image_resolution=(28, 28), tokenizer_max_length=6,
        input_features={
            "observation.images.top": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 28, 28)),
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(6,)),
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(6,))},
    )
    torch.manual_seed(0)
    policy = modeling_pi0.PI0Policy(config)  # built while the feature is on: its model is compiled
    eager = copy.deepcopy(policy)  # the same weights, never compiled
    preset = config.get_optimizer_preset()
    result: dict[str, Any] = {"torch": torch.__version__, "losses": [], "eager_losses": []}
    for name, model in (("losses", policy), ("eager_losses", eager)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=preset.betas, eps=preset.eps,
                                      weight_decay=preset.weight_decay)
        for step in range(STEPS):
            torch.manual_seed(step)  # noise and flow-matching time are drawn inside forward
            loss, _ = model.forward(batch(step, config))
            optimizer.zero_grad()
            loss.backward()
            if step == 0:
                result[f"{name}_grad0"] = {
                    key: p.grad.detach().clone() for key, p in model.named_parameters() if p.grad is not None}
            torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip_norm)
            optimizer.step()
            result[name].append(loss.item())
            print(f"{name} step {step}: {loss.item():.6f}", flush=True)
    grads, eager_grads = result.pop("losses_grad0"), result.pop("eager_losses_grad0")
    assert grads.keys() == eager_grads.keys(), "the same parameters got gradients"
    # per parameter, relative to its largest eager gradient, but never to less than 1e-4 of the model's
    # largest: a key projection's bias has a zero gradient in exact arithmetic (softmax), ~1e-10 here
    top = max(float(g.abs().max()) for g in eager_grads.values())
    rel = {k: float((grads[k] - eager_grads[k]).abs().max()) / max(float(eager_grads[k].abs().max()), 1e-4 * top)
           for k in grads}
    worst = max(rel, key=rel.__getitem__)
    result["grad0_max_rel"], result["grad0_worst"] = rel[worst], worst
    result["grad0_params"] = len(grads)
    # lerobot's own switch: an instance compiled by config.compile_model is left to it (built, not run)
    modeling_pi0.PI0Policy(PI0Config(**{**config.__dict__, "compile_model": True, "compile_mode": "default"}))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
