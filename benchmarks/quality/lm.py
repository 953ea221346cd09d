"""The benchmark's language model: a small Qwen3-MoE over bytes, trained here on the corpus's training split.

Every weight row the quantizers see is several GGML super-blocks of 256 long, so that GPTQ has later blocks of a row
to carry each block's error into: hidden 1024 (q/k/v and expert gate/up rows: 4 blocks), 8 query and 4 key-value
heads of 128 (o rows: 4 blocks), 8 experts of width 512 (down rows: 2 blocks), top-2 routing, 2 decoder layers
(32 M parameters). With rows of a single block GPTQ has nothing to compensate with and gives exactly the plain
encoding. The vocabulary is the 256 byte values. Training is plain next-byte cross entropy plus the model's own
router load-balancing loss, AdamW with a linear warm-up and cosine decay, on random windows of the training split
drawn from a seeded generator.

``DEEP_ARCH`` / ``DEEP_TRAIN`` (``MODELS["deep"]``) is a second, MoE-deeper model that trains in minutes on a CPU: 4
decoder layers of hidden 512 (4 query and 2 key-value heads of 128), 8 experts of width 512 with top-2 routing (every
row 2 super-blocks long), and no load-balancing loss, so that the router uses its experts unevenly (see
:func:`expert_usage`). The trained model is saved with
``save_pretrained`` (safetensors) in ``<cache_dir>/lm-<key>``, the key hashing every hyperparameter and the corpus
digest, so a rerun with the same settings loads it instead of training. Trained on CUDA (``device="cuda"``: seconds
instead of minutes) the model is another one (other rounding in every step), so the device joins the key.

Two more models have the shapes of other MoE families, trained the same way on the same bytes (``family`` in the
architecture names the transformers class; without it, Qwen3-MoE):

- ``MODELS["deepseek_v3"]`` (``DeepseekV3ForCausalLM``, llama.cpp's ``deepseek2``): multi-head latent attention
  (query and key-value low-rank projections of 512, 8 heads with no-rope/rope/value widths 64/32/64), a dense first
  layer (MLP width 1024), then 2 MoE layers of 8 routed experts of width 512 (sigmoid scores, 4 groups of which 2 are
  kept, top-2) beside one shared expert; every quantized row 2-4 super-blocks long.
- ``MODELS["gpt_oss"]`` (``GptOssForCausalLM``): 2 layers (sliding-window attention of 128, then full), 8 query and
  2 key-value heads of 64 with biases and per-head attention sinks, 16 experts of width 512 with biases, top-2 with
  a softmax over the chosen router logits, the clamped SwiGLU, the load-balancing loss.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import numpy as np

from benchmarks.quality.corpus import VOCAB

ARCH = dict(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=1024,
            norm_topk_prob=True, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False, router_aux_loss_coef=0.01)
TRAIN = dict(steps=200, batch=8, length=256, lr=2e-3, warmup=40, weight_decay=0.1, clip=1.0, seed=0)
DEEP_ARCH = dict(ARCH, hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 moe_intermediate_size=512, router_aux_loss_coef=0.0)
DEEP_TRAIN = dict(TRAIN, steps=160, length=128, lr=3e-3, warmup=20)
DEEPSEEK_ARCH = {"family": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 512, "num_hidden_layers": 3,
                 "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 512, "kv_lora_rank": 512,
                 "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "intermediate_size": 1024,
                 "moe_intermediate_size": 512, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                 "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
                 "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
GPT_OSS_ARCH = {"family": "gpt_oss", "vocab_size": VOCAB, "hidden_size": 512, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
                "num_local_experts": 16, "num_experts_per_tok": 2, "sliding_window": 128,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
                "router_aux_loss_coef": 0.01}
SHAPES_TRAIN = {**DEEP_TRAIN, "steps": 120}
MODELS = {"quality": (ARCH, TRAIN), "deep": (DEEP_ARCH, DEEP_TRAIN), "deepseek_v3": (DEEPSEEK_ARCH, SHAPES_TRAIN),
          "gpt_oss": (GPT_OSS_ARCH, SHAPES_TRAIN)}
# transformers' (config, model) classes of each family an architecture may name
FAMILIES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
            "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


def cache_key(arch: dict, train: dict, corpus_digest: str) -> str:
    """A short hash of everything the trained weights depend on."""
    blob = json.dumps({"arch": arch, "train": train, "corpus": corpus_digest, "version": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def classes(arch: dict = ARCH):
    """transformers' (config class, model class) of ``arch`` (its ``family``, Qwen3-MoE when it names none)."""
    import transformers

    config, model = FAMILIES[arch.get("family", "qwen3_moe")]
    return getattr(transformers, config), getattr(transformers, model)


def build(arch: dict = ARCH, seed: int = 0):
    """A freshly initialised float32 model of ``arch``'s family with its settings."""
    import torch

    config, model = classes(arch)
    torch.manual_seed(seed)
    return model(config(**{k: v for k, v in arch.items() if k != "family"})).float()


def load(folder: str, arch: dict = ARCH):
    """The model of ``arch``'s family saved in ``folder``, float32, in eval mode."""
    return classes(arch)[1].from_pretrained(folder, dtype="float32").eval()


def mean_loss(model, windows: np.ndarray, batch: int = 16, first: int = 0) -> float:
    """Mean next-token cross entropy (nats) of ``model`` on int64 windows (n, L), scoring predictions of tokens
    ``first + 1 .. L - 1`` of every window (``first = L // 2`` is llama.cpp's perplexity convention)."""
    import torch

    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            ids = torch.from_numpy(windows[i:i + batch]).to(device)
            logits = model(input_ids=ids).logits.double()
            logp = torch.log_softmax(logits[:, first:-1], -1)
            nll = -logp.gather(-1, ids[:, first + 1:, None]).squeeze(-1)
            total += float(nll.sum())
            count += nll.numel()
    return total / count


def train(model, tokens: np.ndarray, cfg: dict, log=print) -> dict:
    """Trains ``model`` in place, on the device of its parameters, on random windows of ``tokens`` (uint8 bytes).
    Returns the loss history."""
    import torch

    device = next(model.parameters()).device

    g = np.random.default_rng(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95))

    def lr_at(step):
        if step < cfg["warmup"]:
            return cfg["lr"] * (step + 1) / cfg["warmup"]
        frac = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    history, t0 = [], time.perf_counter()
    span = len(tokens) - cfg["length"] - 1
    for step in range(cfg["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = g.integers(0, span, cfg["batch"])
        ids = torch.from_numpy(np.stack([tokens[s:s + cfg["length"]] for s in starts]).astype(np.int64)).to(device)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        aux = getattr(out, "aux_loss", None)
        lm_loss = float(out.loss.detach())
        if aux is not None:  # the logged figure is the language-model loss alone
            lm_loss -= float(aux.detach()) * model.config.router_aux_loss_coef
        history.append(lm_loss)
        if step % 50 == 0 or step == cfg["steps"] - 1:
            log(f"train step {step}/{cfg['steps']}: loss {lm_loss:.3f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"loss_history": history[::10], "final_train_loss": float(np.mean(history[-20:])),
            "train_s": time.perf_counter() - t0, "train_device": str(device)}


def expert_usage(model, windows: np.ndarray, batch: int = 16) -> dict:
    """How often the router picks each expert on int64 windows (n, L).

    Returns: ``counts`` (layers, experts) int token-slot counts of the top-k choices; per layer the share of the
    most and least used expert, ``max_over_mean`` and the normalised entropy of the usage (1.0: even).
    """
    import torch

    k = model.config.num_experts_per_tok
    counts = None
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            out = model(input_ids=torch.from_numpy(windows[i:i + batch]), output_router_logits=True)
            picks = [torch.topk(r.float(), k, dim=-1).indices.reshape(-1) for r in out.router_logits]
            c = np.stack([np.bincount(p.numpy(), minlength=model.config.num_experts) for p in picks])
            counts = c if counts is None else counts + c
    share = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(np.where(share > 0, share * np.log(share), 0.0), axis=1) / math.log(share.shape[1])
    return {"counts": counts.tolist(), "max_share": share.max(axis=1).tolist(),
            "min_share": share.min(axis=1).tolist(), "max_over_mean": (share.max(axis=1) * share.shape[1]).tolist(),
            "normalised_entropy": entropy.tolist()}


def named_model(name: str, cache_dir: str, *, steps: int | None = None, device: str = "cpu"):
    """The corpus's splits and the trained model ``MODELS[name]`` (:func:`trained_model`, from ``cache_dir`` when
    cached, else trained on ``device``): (splits, model on the host, info)."""
    from benchmarks.quality import corpus

    data = corpus.corpus_bytes()
    splits = corpus.split(data)
    arch, train_cfg = MODELS[name]
    model, info = trained_model(splits, corpus.corpus_digest(data), cache_dir, steps=steps, arch=arch,
                                train_cfg=train_cfg, device=device)
    return splits, model, info


def trained_model(splits, corpus_digest: str, cache_dir: str, *, steps: int | None = None, arch: dict = ARCH,
                  train_cfg: dict = TRAIN, log=print, device: str = "cpu"):
    """The trained model for these settings, from ``cache_dir`` when present, else trained on ``device`` ("cpu",
    "cuda", "cuda:1") and cached.

    Returns (model in eval mode, float32, on the host; info dict with the cache folder, training figures and
    held-out loss).
    """
    import torch

    cfg = dict(train_cfg, **({} if steps is None else {"steps": int(steps)}))
    if torch.device(device).type != "cpu":   # CPU-trained models keep the key they had
        cfg["device"] = torch.device(device).type
    if cfg["steps"] < 1:
        raise ValueError(f"train steps: {cfg['steps']} must be at least 1")
    folder = os.path.join(cache_dir, f"lm-{cache_key(arch, cfg, corpus_digest)}")
    info_path = os.path.join(folder, "train_info.json")
    if os.path.exists(info_path):
        model = load(folder, arch)
        with open(info_path) as f:
            info = json.load(f)
        info["cached"] = True
        log(f"loaded the trained model from {folder}")
        return model, info
    model = build(arch, cfg["seed"]).to(device)
    info = {"arch": arch, "train": cfg, "corpus_sha256": corpus_digest, "folder": folder,
            "parameters": sum(p.numel() for p in model.parameters())}
    info.update(train(model, splits.tokens["train"], cfg, log=log))
    from benchmarks.quality.corpus import windows

    held = windows(splits.tokens["heldout"], cfg["length"])
    loss = mean_loss(model, held)
    info.update({"heldout_loss_nats": loss, "heldout_bits_per_byte": loss / math.log(2),
                 "heldout_windows": len(held)})
    log(f"held-out loss {loss:.3f} nats/byte = {loss / math.log(2):.3f} bits/byte")
    model = model.cpu()
    tmp = folder + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    if os.path.exists(folder):  # another run finished first: keep its copy
        import shutil

        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)
    info["cached"] = False
    return model, info
