"""fastmuon.Muon inside 🤗 Transformers' Trainer: a tiny GPT-2 trains, checkpoints and resumes."""

import pytest
import torch
from integration_support import import_offline

import fastmuon
import fastmuon.integrations.transformers

VOCAB, SEQ, STEPS, SAVE_EVERY = 64, 16, 4, 2


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "transformers", str(tmp_path_factory.mktemp("hf_home")))


class Patterns(torch.utils.data.Dataset):
    """Arithmetic token sequences: easy to learn, so the loss falls within a few steps."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = (torch.arange(SEQ) * (1 + i % 3) + i) % VOCAB
        return {"input_ids": ids, "labels": ids}


def tiny_gpt2(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def training_args(transformers, output_dir, **extra):
    """The Trainer's arguments every run here shares: CPU, seed 0, a checkpoint every SAVE_EVERY."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **extra,
    )


def train(transformers, output_dir, resume_from=None):
    """A Trainer on a fresh tiny GPT-2 with fastmuon.Muon as its optimizer; returns both."""
    model = tiny_gpt2(transformers)
    opt = fastmuon.Muon(fastmuon.param_groups(model), lr=0.02, weight_decay=0.01)
    args = training_args(transformers, output_dir)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Patterns(),
        optimizers=(opt, transformers.get_constant_schedule(opt)),
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer, opt


@pytest.fixture(scope="module")
def first_run(transformers, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_run")
    trainer, opt = train(transformers, out)
    return out, trainer, opt


def test_trainer_trains_gpt2_with_muon_on_its_matrices(transformers, first_run):
    _, trainer, opt = first_run
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    muon, other, no_decay = opt.param_groups
    # the blocks' Conv1D weights are orthogonalised; token and position tables take AdamW, and
    # the LM head, tied to the token table, is that same tensor
    assert all(".attn.c_" in n or ".mlp.c_" in n for n in muon["param_names"]) and len(muon["params"]) == 8
    assert other["param_names"] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight
    assert other["lr"] == no_decay["lr"] == 3e-4 and muon["lr"] == 0.02 and no_decay["weight_decay"] == 0
    # each block's fused c_attn is three matrices (query, key, value): 2 blocks x (3 + 3 more)
    assert opt.plan().num_matrices == 12
    assert muon["matrices"][0] == {"split": [64, 64, 64], "transposed": True}
    assert all(set(opt.state[p]) == {"momentum_buffer"} for p in muon["params"])
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in other["params"])
    assert all(float(opt.state[p]["step"]) == STEPS for p in other["params"] + no_decay["params"])


@pytest.mark.slow
def test_trainer_resumes_from_its_checkpoint(transformers, first_run, tmp_path):
    out, trainer, opt = first_run
    resumed, resumed_opt = train(transformers, tmp_path, resume_from=str(out / f"checkpoint-{SAVE_EVERY}"))
    assert resumed.state.global_step == STEPS
    for (name, a), b in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    muon_param = resumed_opt.param_groups[0]["params"][0]
    torch.testing.assert_close(
        resumed_opt.state[muon_param]["momentum_buffer"],
        opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"],
    )
    assert [g["param_names"] for g in resumed_opt.param_groups] == [
        g["param_names"] for g in opt.param_groups
    ]


def test_param_groups_finds_transformers_heads(transformers):
    """An untied LM head (Llama) and a classifier (BERT) leave Muon; so do all embedding tables."""
    small = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2))
    muon, other, _ = fastmuon.param_groups(llama)
    assert other["param_names"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert len(muon["params"]) == 7  # q, k, v, o, gate, up, down
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(**small))
    muon, other, _ = fastmuon.param_groups(bert)
    assert other["param_names"] == [
        f"bert.embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")
    ] + ["classifier.weight"]
    assert "bert.pooler.dense.weight" in muon["param_names"]


# ----- the optimizer factories: Trainer(optimizer_cls_and_kwargs=(Factory, kwargs)) -------------
def train_with_factory(transformers, output_dir, factory, kwargs, resume_from=None):
    """A Trainer that builds its optimizer by calling ``factory()(model, **kwargs)``."""
    model = tiny_gpt2(transformers)
    args = training_args(transformers, output_dir, lr_scheduler_type="constant")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Patterns(), optimizer_cls_and_kwargs=(factory, kwargs)
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


@pytest.fixture(scope="module")
def factory_run(transformers, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_factory_run")
    kwargs = {"lr": 0.02, "weight_decay": 0.01}
    return (
        out,
        kwargs,
        train_with_factory(transformers, out, fastmuon.integrations.transformers.MuonFactory, kwargs),
    )


def test_muon_factory_builds_fastmuons_groups_from_the_model(transformers, first_run, factory_run):
    """The Trainer calls the factory with the model: the groups are param_groups(model)'s, and the
    run takes the same updates as one given the optimizer built by hand."""
    _, by_hand, opt = first_run
    _, _, trainer = factory_run
    built = trainer.optimizer.optimizer  # accelerate's wrapper holds it
    assert isinstance(built, fastmuon.Muon)
    assert [g["param_names"] for g in built.param_groups] == [g["param_names"] for g in opt.param_groups]
    assert [g["use_muon"] for g in built.param_groups] == [True, False, False]
    assert built.param_groups[0]["lr"] == 0.02 and built.param_groups[1]["lr"] == 3e-4
    assert "Muon takes 8 of 28 parameters (12 matrices" in built.plan().describe()
    for (name, a), b in zip(by_hand.model.named_parameters(), trainer.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_factory_run_resumes_with_the_same_updates(transformers, factory_run, tmp_path):
    out, kwargs, trainer = factory_run
    factory = fastmuon.integrations.transformers.MuonFactory
    resumed = train_with_factory(
        transformers, tmp_path, factory, kwargs, resume_from=str(out / f"checkpoint-{SAVE_EVERY}")
    )
    assert resumed.state.global_step == STEPS
    for (name, a), b in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    first, then = trainer.optimizer.optimizer, resumed.optimizer.optimizer
    assert isinstance(then, fastmuon.Muon)
    for p, q in zip(first.param_groups[0]["params"], then.param_groups[0]["params"]):
        torch.testing.assert_close(then.state[q]["momentum_buffer"], first.state[p]["momentum_buffer"])


def test_musgd_factory_and_group_keywords(transformers, tmp_path):
    """Group keywords (head=, exclude=, ...) shape the groups; the rest reach the constructor."""
    kwargs = {"lr": 0.02, "momentum": 0.9, "exclude": "*.mlp.c_proj", "ns_dtype": torch.float32}
    trainer = train_with_factory(
        transformers, tmp_path, fastmuon.integrations.transformers.MuSGDFactory, kwargs
    )
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, fastmuon.MuSGD) and opt.param_groups[0]["ns_dtype"] == torch.float32
    assert not any(n.endswith("mlp.c_proj.weight") for n in opt.param_groups[0]["param_names"])
    assert "transformer.h.0.mlp.c_proj.weight" in opt.param_groups[1]["param_names"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert kwargs == {"lr": 0.02, "momentum": 0.9, "exclude": "*.mlp.c_proj", "ns_dtype": torch.float32}
