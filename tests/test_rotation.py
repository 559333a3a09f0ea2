"""The per-head Hadamard rotation of the values (--rotate v_o): the matrix, exactness on every dense
model type of the zoo that has a v -> o pair (grouped-query and fused qkv included), refusal (the
model left as it was) where the model would change, and `qtk quantize --rotate v_o` end to end."""
from __future__ import annotations

import pytest
import torch

import zoo
from qtk import pipeline, rotation
from qtk.arch import discover
from qtk.errors import InputError
from qtk.recipe import build


def test_hadamard_is_orthogonal_symmetric_and_sylvester():
    h = rotation.hadamard(16)
    torch.testing.assert_close(h @ h.t(), torch.eye(16, dtype=torch.float64))
    assert torch.equal(h, h.t()) and torch.allclose(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    h2 = rotation.hadamard(2) * 2 ** 0.5
    assert torch.equal(h2, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    with pytest.raises(InputError, match="powers of two"):
        rotation.hadamard(12)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("model_type", sorted(zoo.DENSE))
def test_the_rotated_model_computes_the_same_function(model_type):
    model = zoo.tiny(model_type)
    arch = discover(model)
    has_pair = any(p.prev.startswith(f"{arch.attention[i]}.") and len(p.linears) == 1
                   for i, ps in enumerate(arch.smooth) for p in ps)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    v_before = {n: m.weight.clone() for n, m in model.named_modules() if n.endswith(("v_proj", "qkv_proj"))}
    if not has_pair:
        with pytest.raises(InputError, match="no values -> output projection pair"):
            rotation.rotate_values(model, arch)
        return
    assert rotation.rotate_values(model, arch) == len(arch.smooth)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    changed = [n for n, m in model.named_modules() if n in v_before and not torch.equal(m.weight, v_before[n])]
    assert changed  # the weights moved, the function did not


def test_a_model_the_rotation_would_change_is_refused_and_left_as_it_was(monkeypatch):
    model = zoo.tiny("llama")
    arch = discover(model)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    monkeypatch.setattr(rotation, "_rotate_columns", lambda linear, H: None)  # o_proj no longer undoes it
    with pytest.raises(InputError, match="changes the model's outputs"):
        rotation.rotate_values(model, arch)
    assert torch.equal(_logits(model, ids), before)


def test_quantize_with_the_rotation(tiny_dir, tmp_path):
    """The rotation is written into the recipe and the weights, and the int8 checkpoint of the rotated
    model is as close to the float model as the unrotated one's (the rotation changes no function)."""
    from qtk.evals.perplexity import eval_windows
    from qtk.loading import load_model

    base, tok = load_model(str(tiny_dir), dtype=torch.float32)
    windows = eval_windows(tok, "builtin", 64, 4)
    p = _logits(base, windows).log_softmax(-1)

    def kl(path):
        q = _logits(load_model(str(path), dtype=torch.float32)[0], windows).log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1).mean().item()

    for rotate in ((), ("v_o",)):
        recipe = build(method="rtn", scheme="w8a16", dtype="float32", rotate=rotate)
        pipeline.quantize(str(tiny_dir), recipe, tmp_path / f"q{len(rotate)}", progress=False)
    assert build(recipe_file=str(tmp_path / "q1" / "recipe.yaml")).rotate == ("v_o",)
    assert kl(tmp_path / "q1") < 1e-3 and kl(tmp_path / "q0") < 1e-3
    with pytest.raises(InputError, match="rotate must"):
        build(rotate=("r1",))


def test_a_bf16_model_is_checked_in_float32_and_stays_bf16(bundled_dir):
    """The bundled model in bfloat16: a bf16 forward departs from float32's by more than the check's
    limit on its tokens, so the check runs in float32; the rotated weights are rounded once, back to
    each parameter's own dtype, and its float32 buffers (rotary frequencies) stay float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.bfloat16)
    params = {n: p.dtype for n, p in model.named_parameters()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    v = model.model.layers[0].self_attn.v_proj.weight.double()
    assert rotation.rotate_values(model, discover(model)) == model.config.num_hidden_layers
    assert {n: p.dtype for n, p in model.named_parameters()} == params
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
    H = rotation.hadamard(64)
    want = (H.t() @ v.reshape(-1, 64, v.shape[1])).reshape(v.shape).to(torch.bfloat16)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, want)
