"""The residual stream's rotation (--rotate residual: QuaRot's Q, SpinQuant's R1), fused into the
weights after the norms' weights are folded: Hadamard matrices of orders that are not powers of two
(Paley's constructions), exactness on every dense model type of the zoo it accepts, refusal (the
model left as it was) on the others, tied embeddings untied, and `qtk quantize --rotate residual` end
to end: a plain checkpoint that the loader and qtk's runtime read to the float model's outputs."""
from __future__ import annotations

import json

import pytest
import torch

import zoo
from qtk import hadamard, pipeline, rotation
from qtk.arch import discover
from qtk.errors import InputError
from qtk.recipe import build
from test_online_rotation import assert_engine_greedy_is_the_loaders  # noqa: E402
from test_rotation import _logits  # noqa: E402  (the same no-grad forward as the other rotations' tests)

# the dense types whose residual stream only norms read and only the blocks' output projections write
ROTATES = {"arcee", "ernie4_5", "gemma", "glm", "granite", "helium", "hunyuan_v1_dense", "llama", "ministral",
           "mistral", "phi3", "qwen2", "qwen3", "seed_oss", "smollm3", "vaultgemma"}


@pytest.mark.parametrize("n", [12, 20, 28, 36, 60, 576, 896, 960, 1536])
def test_hadamard_matrices_of_orders_that_are_not_powers_of_two(n):
    h = hadamard.hadamard_matrix(n)
    torch.testing.assert_close(h @ h.t(), torch.eye(n, dtype=torch.float64))
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


def test_paley_constructions_and_the_orders_without_one():
    for n in (12, 20, 36):  # I (q = 11, 19) and II (q = 17)
        h = hadamard.paley(n)
        assert set(h.unique().tolist()) == {-1.0, 1.0}
        assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    assert hadamard.paley(52) is None and hadamard.hadamard_matrix(52) is None  # 51 and 25 are not prime
    assert torch.equal(hadamard.hadamard_matrix(64), hadamard.sylvester(64))


def test_the_residual_matrix_is_orthogonal_signed_and_seeded():
    q = rotation.residual_matrix(576)
    torch.testing.assert_close(q @ q.t(), torch.eye(576, dtype=torch.float64))
    assert torch.equal(q, rotation.residual_matrix(576))
    assert not torch.equal(q, rotation.residual_matrix(576, seed=1))
    h = hadamard.hadamard_matrix(576)
    signs = (q / h)[:, 0]
    assert set(signs.unique().tolist()) == {-1.0, 1.0} and torch.allclose(q, signs[:, None] * h)
    r = rotation.residual_matrix(52)  # no Hadamard matrix of that order: a random orthogonal one
    torch.testing.assert_close(r @ r.t(), torch.eye(52, dtype=torch.float64))


def _with_norm_weights(model):
    """Random norm weights (a fresh model's are ones, which would make the fold a no-op)."""
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "norm" in name.split(".")[-2].lower() and p.dim() == 1:
            p.data = 0.5 + torch.rand(p.shape, generator=g)
    return model


@pytest.mark.parametrize("model_type", sorted(zoo.DENSE))
def test_the_rotated_model_computes_the_same_function(model_type):
    model = _with_norm_weights(zoo.tiny(model_type))
    arch = discover(model)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    params = {n: p.clone() for n, p in model.named_parameters()}
    if model_type not in ROTATES:
        with pytest.raises(InputError, match="changes the model's outputs|norms have a bias|norms outside"):
            rotation.rotate_residual(model, arch)
        assert torch.equal(_logits(model, ids), before)
        assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
        return
    embed = model.get_input_embeddings().weight.clone()
    assert rotation.rotate_residual(model, arch) == len(arch.smooth)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model.get_input_embeddings().weight, embed, atol=1e-3)  # the weights moved
    layers = model.get_submodule(arch.layers)
    folded = [rotation._final_norm(model, arch)] + [layers[i].get_submodule(p.prev) for i, pairs in
                                                     enumerate(arch.smooth) for p in pairs
                                                     if not isinstance(layers[i].get_submodule(p.prev), torch.nn.Linear)]
    offset = next(p.offset for pairs in arch.smooth for p in pairs)
    assert len(folded) > len(layers) and all(torch.equal(m.weight, torch.full_like(m.weight, 1.0 - offset))
                                             for m in folded)


def test_tied_embeddings_are_untied_and_a_refusal_leaves_them_tied():
    model = _with_norm_weights(zoo.tiny("llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    rotation.rotate_residual(model, discover(model))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False and not model.get_expanded_tied_weights_keys(all_submodels=True)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)

    refused = _with_norm_weights(zoo.tiny("gemma2", tie_word_embeddings=True))  # norms after attention and MLP
    with pytest.raises(InputError, match="changes the model's outputs"):
        rotation.rotate_residual(refused, discover(refused))
    assert refused.lm_head.weight is refused.model.embed_tokens.weight and refused.config.tie_word_embeddings


def test_a_model_the_rotation_would_change_is_refused_and_left_as_it_was(monkeypatch):
    model = _with_norm_weights(zoo.tiny("llama"))
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    q = rotation.residual_matrix(64)
    monkeypatch.setattr(rotation, "residual_matrix", lambda n: q[torch.randperm(64)].t())  # orthogonal, not Q's
    monkeypatch.setattr(rotation, "_final_norm", lambda m, a: m.model.layers[0].input_layernorm)  # the wrong norm
    with pytest.raises(InputError, match="changes the model's outputs"):
        rotation.rotate_residual(model, discover(model))
    assert torch.equal(_logits(model, ids), before)


@pytest.fixture(scope="module")
def rotated(tiny_dir, tmp_path_factory):
    """The tiny Llama (tied embeddings) with random norm weights, quantized int8 with every rotation."""
    from qtk.loading import load_model

    base, tok = load_model(str(tiny_dir), dtype=torch.float32)
    _with_norm_weights(base)
    d = tmp_path_factory.mktemp("residual")
    base.save_pretrained(d / "base")
    tok.save_pretrained(d / "base")
    recipe = build(method="rtn", scheme="w8a16", dtype="float32", rotate=("residual", "v_o", "down"))
    pipeline.quantize(str(d / "base"), recipe, d / "q", progress=False)
    return d / "base", d / "q"


def test_quantize_with_the_residual_rotation(rotated):
    """A plain compressed-tensors checkpoint with lm_head apart, as close to the float model as int8
    rounding allows, through the loader and through qtk's runtime."""
    from safetensors import safe_open

    from qtk.evals.perplexity import eval_windows
    from qtk.loading import load_model

    base_dir, q = rotated
    base, tok = load_model(str(base_dir), dtype=torch.float32)
    assert base.config.tie_word_embeddings
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    assert build(recipe_file=str(q / "recipe.yaml")).rotate == ("residual", "v_o", "down")
    windows = eval_windows(tok, "builtin", 64, 4)
    p = _logits(base, windows).log_softmax(-1)
    model = load_model(str(q), dtype=torch.float32)[0]
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    got = _logits(model, windows).log_softmax(-1)
    assert (p.exp() * (p - got)).sum(-1).mean().item() < 1e-3

    assert_engine_greedy_is_the_loaders(q, model)
