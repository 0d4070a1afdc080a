"""QK-clip on 🤗 Transformers models: the recorder's per-head maxima against all heads' logits
recomputed from the layer's own projections (tiny Llama and DeepSeek-V3, eager and SDPA), the
parts ``param_groups(attention=True)`` finds, training with the recorder attached against a loop
of the per-head references, and the Trainer recipe with a checkpoint resume."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import rel_err
from integration_support import import_offline
from reference_impl import logit_maxima_reference, mla_qk_clip_reference, qk_clip_reference

import fastmuon
from fastmuon.integrations.logit_max import LogitMaxRecorder

VOCAB, SEQ, BATCH = 40, 8, 3
LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
DEEPSEEK = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=48,
    n_routed_experts=4,
    moe_intermediate_size=8,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=4,
)
TAU = 4.0
MUON = dict(lr=0.02, weight_decay=0.01, ns_dtype=torch.float32)


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "transformers", str(tmp_path_factory.mktemp("hf_home")))


def build(transformers, which, implementation="sdpa", **extra):
    """A tiny model of 2 layers, weights drawn large enough that some heads' logits pass τ."""
    model_class, config_class, sizes = {
        "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", DEEPSEEK),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", LLAMA),
    }[which]
    config = getattr(transformers, config_class)(**{**sizes, **extra}, num_hidden_layers=2, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4) if p.ndim >= 2 else p.uniform_(0.8, 1.2)
    model.set_attn_implementation(implementation)
    return model.train()


def batch(seed: int, padded: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids}
    if padded:  # right padding: every query keeps some key
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, 5:] = 0
        mask[2, 3:] = 0
        out["attention_mask"] = mask
    return out


# ----- the reference maxima: every head's logits at once, from the layer's own projections ---------
class AttentionInputs:
    """The hidden states and rotary tables each attention layer is called with."""

    def __init__(self, model):
        self.calls: dict[str, list] = {}
        self.handles = [
            m.register_forward_pre_hook(self.hook(name), with_kwargs=True)
            for name, m in model.named_modules()
            if name.endswith("self_attn")
        ]
        self.modules = dict(model.named_modules())

    def hook(self, name):
        def save(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.calls.setdefault(name, []).append((x.detach(), kwargs["position_embeddings"]))

        return save

    def maxima(self, keep) -> dict[str, torch.Tensor]:
        """Per layer, the largest logit of its calls since the last ``maxima``."""
        out = {}
        for name, calls in self.calls.items():
            attn = self.modules[name]
            per_call = [
                logit_maxima_reference(*query_key(attn, x, rope), attn.scaling, keep) for x, rope in calls
            ]
            out[name] = torch.stack(per_call).amax(0).float()
        self.calls = {}
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def query_key(attn, x, rope):
    """The layer's queries and keys after RoPE, computed from its projections as its forward does."""
    modeling = sys.modules[type(attn).__module__]
    b, n, _ = x.shape
    cos, sin = rope
    if hasattr(attn, "kv_b_proj"):  # DeepSeek's multi-head latent attention
        nope, rot, v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, n, -1, nope + rot).transpose(1, 2)
        q_pass, q_rot = q.split([nope, rot], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rot], dim=-1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(b, n, -1, nope + v).transpose(1, 2)
        rotate = (
            modeling.apply_rotary_pos_emb_interleave
            if attn.config.rope_interleave
            else modeling.apply_rotary_pos_emb
        )
        q_rot, k_rot = rotate(q_rot, k_rot.view(b, 1, n, rot), cos, sin)
        heads = q.shape[1]
        return torch.cat([q_pass, q_rot], -1), torch.cat(
            [kv[..., :nope], k_rot.expand(-1, heads, -1, -1)], -1
        )
    q = attn.q_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, n, -1, attn.head_dim).transpose(1, 2)
    return modeling.apply_rotary_pos_emb(q, k, cos, sin)


def keep_of(inputs) -> torch.Tensor:
    """The (batch, queries, keys) entries causal attention with the padding mask uses."""
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    pad = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    return causal[None] & pad[:, None, :]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("which", ["llama", "deepseek_v3"])
def test_the_recorded_maxima_are_each_heads_largest_logit_of_the_forward(transformers, which, implementation):
    model = build(transformers, which, implementation)
    inputs = batch(0, padded=True)
    with torch.no_grad():
        plain = model(**inputs).logits
    reference = AttentionInputs(model)
    with LogitMaxRecorder(model) as recorder:
        assert model.config._attn_implementation == f"fastmuon_logit_max_{implementation}"
        with torch.no_grad():
            recorded = model(**inputs).logits
            second = batch(1, padded=True)
            model(**second)  # a second forward of the step (gradient accumulation): the larger wins
        maxima = recorder.take()
        assert recorder.take() is None  # taken: a fresh start
    assert model.config._attn_implementation == implementation  # closed: as it was
    assert torch.equal(recorded, plain)  # recording changes nothing the model computes
    reference.calls = {n: calls[:1] for n, calls in reference.calls.items()}
    first = reference.maxima(keep_of(inputs))
    # the reference of the second forward
    with torch.no_grad():
        model(**second)
    again = reference.maxima(keep_of(second))
    assert set(maxima) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    for name, got in maxima.items():
        want = torch.maximum(first[name], again[name])
        assert got.shape == (4,) and rel_err(got, want) < 1e-5, (name, got, want)
    assert max(float(m.max()) for m in maxima.values()) > TAU  # the models here do clip


def test_only_training_forwards_are_recorded_and_other_setups_are_refused(transformers):
    model = build(transformers, "llama")
    recorder = LogitMaxRecorder(model)
    model.eval()
    with torch.no_grad():
        model(**batch(0))
    assert recorder.take() is None
    model.train()
    model(**batch(0))
    assert recorder.take() is not None
    recorder.close()
    model(**batch(0))  # closed: nothing recorded, nothing handed in
    assert recorder.take() is None
    flash = build(transformers, "llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(
        ValueError, match="eager or sdpa attention; .*'flash_attention_2'.*set_attn_implementation"
    ):
        LogitMaxRecorder(flash)
    with pytest.raises(ValueError, match="Transformers models"):
        LogitMaxRecorder(torch.nn.Linear(3, 3))


# ----- the parts param_groups finds -----------------------------------------------------------------
def test_param_groups_names_the_queries_and_keys_of_llama_and_deepseek(transformers):
    llama = build(transformers, "llama", attention_bias=True)
    assert all("attention" not in g for g in fastmuon.param_groups(llama))  # only when asked
    muon, other, no_decay = fastmuon.param_groups(llama, attention=True)
    assert "attention" not in other
    parts = {n: a for g in (muon, no_decay) for n, a in zip(g["param_names"], g["attention"]) if a}
    layer = "model.layers.1.self_attn"
    assert (
        parts[f"{layer}.q_proj.weight"]
        == parts[f"{layer}.q_proj.bias"]
        == {"layer": layer, "part": "query", "heads": 4}
    )
    assert parts[f"{layer}.k_proj.bias"] == {"layer": layer, "part": "key", "heads": 2}
    assert len(parts) == 8  # q and k, weight and bias, of 2 layers; nothing else
    deepseek = build(transformers, "deepseek_v3")
    muon = fastmuon.param_groups(deepseek, attention=True)[0]
    parts = {n: a for n, a in zip(muon["param_names"], muon["attention"]) if a}
    layer = "model.layers.0.self_attn"
    assert parts == {
        **parts,
        f"{layer}.q_b_proj.weight": {
            "layer": layer,
            "part": "mla_query",
            "heads": 4,
            "nope_dim": 4,
            "rope_dim": 4,
        },
        f"{layer}.kv_b_proj.weight": {
            "layer": layer,
            "part": "mla_key_value",
            "heads": 4,
            "nope_dim": 4,
            "v_dim": 4,
        },
    }
    assert len(parts) == 4 and not any("kv_a_proj" in n for n in parts)  # the shared rotary key: no part
    # per-head query/key norms (Qwen3) make scaling the projections moot: not recognised
    with pytest.raises(ValueError, match="found no attention query or key parameter.*attention=\\{"):
        fastmuon.param_groups(build(transformers, "qwen3"), attention=True)
    # given by name instead
    groups = fastmuon.param_groups(
        build(transformers, "qwen3"), attention={"*.q_proj": {"part": "query", "heads": 4}}
    )
    assert groups[0]["attention"][0] == {"layer": "model.layers.0.self_attn", "part": "query", "heads": 4}
    with pytest.raises(
        ValueError,
        match="attention part of 'model.layers.0.self_attn.k_proj.weight' .*do not split into 3 heads.*attention=",
    ):
        fastmuon.param_groups(llama, attention={"*.k_proj": {"part": "key", "heads": 3}})


@pytest.mark.parametrize("which", ["llama", "deepseek_v3", "deepseek_v3 without a query LoRA"])
@pytest.mark.parametrize("clipped", [0, 1])
def test_each_part_scales_its_own_heads_logits(transformers, which, clipped):
    """With the update a no-op (learning rates 0), clipping one layer scales each of its heads'
    logits by the product of its query and key factors: ``γ_h^α·(min γ of its key head's
    queries)^(1−α)`` in GQA, ``γ_h`` in MLA (content and rotary logits alike; its query
    projection ``q_proj`` where there is no query LoRA). So the parts map each row to the head
    whose logits it makes."""
    extra = {"q_lora_rank": None} if "without" in which else {}
    model = build(transformers, which.split()[0], **extra)
    recorder = LogitMaxRecorder(model)
    groups = fastmuon.param_groups(model, attention=True)
    opt = fastmuon.Muon(groups, lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip_tau=TAU, qk_clip_alpha=0.3)
    inputs = batch(0)
    model(**inputs).loss.backward()
    before = recorder.take()
    layer = f"model.layers.{clipped}.self_attn"
    over = {n: m if n == layer else torch.zeros_like(m) for n, m in before.items()}  # clip one layer
    opt.step(logit_maxima=over)
    with torch.no_grad():
        model(**inputs)
    after = recorder.take()[layer]
    s = before[layer].double()
    gamma = torch.where(s > TAU, TAU / s, torch.ones_like(s))
    if which == "llama":
        group = gamma.view(2, 2).amin(1).repeat_interleave(2)  # 4 query heads, 2 key heads
        want = s * gamma**0.3 * group**0.7
    else:
        want = s * gamma
    assert (s > TAU).any() and rel_err(after, want) < 1e-5, (after, want)
    assert float(after.max()) <= TAU * (1 + 1e-5)


# ----- training: the recorder attached, against the per-head references ---------------------------
def reference_clip(model, maxima, alpha=0.5):
    """QK-clip of every attention layer of ``model`` by the reference rules, in place."""
    with torch.no_grad():
        for name, s in maxima.items():
            attn = model.get_submodule(name)
            if hasattr(attn, "kv_b_proj"):
                dims = dict(nope=attn.qk_nope_head_dim, rope=attn.qk_rope_head_dim, v=attn.v_head_dim)
                q, kv = attn.q_b_proj.weight, attn.kv_b_proj.weight
                new_q, new_kv = mla_qk_clip_reference(q, kv, s, heads=4, **dims, tau=TAU, alpha=alpha)
                q.copy_(new_q)
                kv.copy_(new_kv)
            else:
                q, k = attn.q_proj.weight, attn.k_proj.weight
                new_q, new_k = qk_clip_reference(q, k, s, heads=4, kv_heads=2, tau=TAU, alpha=alpha)
                q.copy_(new_q)
                k.copy_(new_k)


def reference_step(model, optimizer, inputs, data, max_grad_norm=None):
    """One step of Muon without QK-clip, then the reference clip by the reference maxima."""
    model(**data).loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    maxima = inputs.maxima(keep_of(data))
    optimizer.step()
    optimizer.zero_grad()
    reference_clip(model, maxima)
    return maxima


def assert_same_weights(model, reference, tol=1e-5):
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(a.detach(), b.detach()) < tol, name


@pytest.mark.parametrize("which", ["llama", "deepseek_v3"])
def test_training_with_the_recorder_attached_follows_the_per_head_reference(transformers, which):
    model = build(transformers, which)
    recorder = LogitMaxRecorder(model)
    opt = fastmuon.Muon(fastmuon.param_groups(model, attention=True), qk_clip_tau=TAU, **MUON)
    handle = recorder.attach(opt)
    reference = build(transformers, which)
    inputs = AttentionInputs(reference)
    ref_opt = fastmuon.Muon(fastmuon.param_groups(reference), **MUON)
    clipped = 0
    for step in range(3):
        data = batch(step)
        model(**data).loss.backward()
        opt.step()
        opt.zero_grad()
        maxima = reference_step(reference, ref_opt, inputs, data)
        clipped += sum(int((m > TAU).sum()) for m in maxima.values())
        assert_same_weights(model, reference)
    assert clipped > 0
    handle.remove()  # detached: a step takes no maxima, and says so
    model(**batch(3)).loss.backward()
    with pytest.warns(UserWarning, match="no attention logit maxima for this step"):
        opt.step()


# ----- the Trainer recipe ----------------------------------------------------------------------
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


STEPS, SAVE_EVERY = 4, 2


def train(transformers, output_dir, resume_from=None):
    """The recipe: a recorder on the model, attached to fastmuon.Muon, which the Trainer steps."""
    model = build(transformers, "llama")
    recorder = LogitMaxRecorder(model)
    opt = fastmuon.Muon(fastmuon.param_groups(model, attention=True), qk_clip_tau=TAU, **MUON)
    recorder.attach(opt)
    calls = []  # what each training forward is called with, to replay in the reference

    def save(module, args, kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "fastmuon_logit_recorder"})

    model.register_forward_pre_hook(save, with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        optimizers=(opt, transformers.get_constant_schedule(opt)),
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer, opt, calls


@pytest.fixture(scope="module")
def trained(transformers, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_qk_clip")
    return (out, *train(transformers, out))


def test_the_trainer_recipe_clips_as_the_reference_loop(transformers, trained):
    """Replaying the Trainer's forwards (its gradient clipping at 1.0 too) through Muon without
    QK-clip and the per-head references gives the Trainer's weights."""
    _, trainer, opt, calls = trained
    assert len(calls) == STEPS
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(map(torch.isfinite, map(torch.tensor, losses)))
    reference = build(transformers, "llama")
    inputs = AttentionInputs(reference)
    ref_opt = fastmuon.Muon(fastmuon.param_groups(reference), **MUON)
    clipped = 0
    for data in calls:
        maxima = reference_step(reference, ref_opt, inputs, data, max_grad_norm=trainer.args.max_grad_norm)
        clipped += sum(int((m > TAU).sum()) for m in maxima.values())
    assert clipped > 0
    assert_same_weights(trainer.model, reference)
    assert trainer.optimizer.optimizer is opt


def test_the_trainer_resumes_with_the_same_clipped_steps(transformers, trained, tmp_path):
    out, trainer, opt, _ = trained
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no step goes without maxima
        resumed, resumed_opt, calls = train(
            transformers, tmp_path, resume_from=str(out / f"checkpoint-{SAVE_EVERY}")
        )
    assert resumed.state.global_step == STEPS and len(calls) == STEPS - SAVE_EVERY
    assert_same_weights(resumed.model, trainer.model)
    assert resumed_opt.param_groups[0]["attention"] == opt.param_groups[0]["attention"]
    assert resumed_opt.param_groups[0]["qk_clip_tau"] == TAU


def test_a_step_given_its_own_maxima_takes_those_and_drops_the_recorded(transformers):
    model = build(transformers, "llama")
    recorder = LogitMaxRecorder(model)
    opt = fastmuon.Muon(
        fastmuon.param_groups(model, attention=True), lr=0.0, adamw_lr=0.0, weight_decay=0.0, qk_clip_tau=TAU
    )
    recorder.attach(opt)
    model(**batch(0)).loss.backward()
    q = model.model.layers[0].self_attn.q_proj.weight
    before = q.detach().clone()
    low = {f"model.layers.{i}.self_attn": torch.zeros(4) for i in range(2)}
    opt.step(logit_maxima=low)  # no head over τ: nothing scaled, whatever the recorder saw
    assert torch.equal(q, before) and recorder.take() is None
