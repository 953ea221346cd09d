"""How much a matrix's output error reaches the model's next-token distribution: the gain of ``target_bpw``.

A quantized matrix changes its output ``y`` on token ``t`` by ``d_t = (W - Q) x_t``. To second order, the mean
KL divergence from the float model's next-token distribution to the perturbed one is
``1/2 E_t[d_t^T F_t d_t]``, with ``F_t`` the Fisher information of the model's output distribution with respect
to ``y``: ``F = E_{labels ~ model}[g g^T]``, ``g`` the gradient of the log-likelihood of the labels. Keeping only
its diagonal, averaged over the tokens and output rows of the matrix, gives one number per matrix, the *gain*
``G = mean(g^2)``, and the estimate ``KL ~= 1/2 G * mean_t |d_t|^2`` (``d`` assumed independent of ``g``).
``mean_t |d_t|^2`` is the GPTQ objective ``tr((W - Q) H (W - Q)^T) / 2`` with ``H = 2/N sum x x^T``, scaled by the
share of the calibration tokens the matrix sees (:mod:`jgptq_torch.pipeline.sensitivity`).

:func:`fisher_gains` measures ``G`` with one backward pass per calibration batch it is given (``target_bpw`` gives
it the first half: :func:`jgptq_torch.pipeline.sensitivity.gain_batches`) through the float model, the
labels drawn from the model's own next-token distribution (a fixed seed: the same gains every run), so that the
quadratic form is the one of the KL to the float model, not of the data's likelihood. Parameters get no
gradients; only the activations do. Experts: the gradient reaching expert ``e``'s down projection on a token is
its routing weight times the gradient of the experts module's output; the one reaching its gate/up projection is
computed by running that expert's forward again under autograd. Expert biases are left out of that forward.
An experts stack that is a module of its own (JetMoe's) gets the gradient of its own output rows, expert by expert.

The pass runs the whole model forward and backward on each batch, where the model is
(:mod:`jgptq_torch.pipeline.sensitivity` first brings a model held in host memory to the run's CUDA device when it takes at
most half of the free memory there). A model too large for that runs the pass in host memory, slowly; use
``target_gain="one"`` (unweighted GPTQ losses) there until the pass runs layer by layer.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from jgptq_torch import models


class _Sums:
    """Per parameter: sum of squared gradients and the count of (token, row) entries, per matrix of its stack."""

    def __init__(self):
        self.sq: dict = {}
        self.n: dict = {}

    def add(self, param: str, index: int, count: int, sq: float, n: int) -> None:
        self.sq.setdefault(param, np.zeros(count))[index] += sq
        self.n.setdefault(param, np.zeros(count))[index] += n

    def gains(self) -> dict:
        return {p: np.where(self.n[p] > 0, self.sq[p] / np.maximum(self.n[p], 1), 0.0) for p in self.sq}


def _gate_up_grad(module, layout, e: int, x: torch.Tensor, g_y: torch.Tensor) -> torch.Tensor:
    """The gradient reaching expert ``e``'s gate/up output (tokens, up_rows) for ``g_y`` at its down output."""
    w_up = layout.linear(getattr(module, layout.up_name))[e].detach().float()
    w_down = layout.linear(module.down_proj)[e].detach().float()
    act = getattr(module, "act_fn", torch.nn.functional.silu)
    with torch.enable_grad():
        gu = (x.float() @ w_up.T).detach().requires_grad_(True)
        if layout.gated:
            g_rows, u_rows = layout.gate_up_rows()
            a = act(gu[:, g_rows]) * gu[:, u_rows]
        else:
            a = act(gu)
        y = a @ w_down.T
        (grad,) = torch.autograd.grad((y * g_y.float()).sum(), gu)
    return grad


def _on_stack(sums: _Sums, state: dict, routing, param: str, n_exp: int):
    """The forward hook of an experts stack (:class:`jgptq_torch.models.StackLayout`): the gradient reaching its
    output rows, each expert's rows apart (padding tokens left out by the rows' tokens)."""
    from jgptq_torch.pipeline.stacked_capture import stack_arguments

    def hook(mod, args, kwargs, out):
        x, sizes = stack_arguments(mod, args, kwargs)
        tok, _, counts = routing.rows(mod, x, sizes)
        keep = state["keep"]
        kept = torch.ones(tok.shape, dtype=torch.bool) if keep is None else keep.to(tok.device)[tok]

        def on_grad(g):
            g2 = g.detach().float().reshape(-1, g.shape[-1]) ** 2
            for e, (rows, k) in enumerate(zip(g2.split(counts), kept.to(g2.device).split(counts))):
                if bool(k.any()):
                    sums.add(param, e, n_exp, float(rows[k].sum()), rows[k].numel())
        if out.requires_grad:
            out.register_hook(on_grad)
    return hook


@contextlib.contextmanager
def _hooks(layers, found, prefix: str, sums: _Sums, state: dict):
    from jgptq_torch.pipeline.stacked_capture import Routing

    handles, pending, routing = [], [], Routing()
    for i, (layer, target) in enumerate(zip(layers, found)):
        base = f"{prefix}.{i}"
        for name, module in target.linears.items():
            param = f"{base}.{name}.weight"

            def on_linear(mod, args, out, param=param):
                keep = state["keep"]

                def on_grad(g):
                    g2 = g.detach().float().reshape(-1, g.shape[-1]) ** 2
                    rows = g2[keep] if keep is not None and g2.shape[0] == keep.numel() else g2
                    sums.add(param, 0, 1, float(rows.sum()), rows.numel())
                if out.requires_grad:
                    out.register_hook(on_grad)
            handles.append(module.register_forward_hook(on_linear))
        for name, (module, layout) in target.experts.items():
            if isinstance(layout, models.RowsLayout):
                raise models.UnsupportedModelError(
                    f"{base}.{name} ({type(module).__name__}): the output gradients of experts kept as blocks of rows "
                    f"are not read; a budget allocation (target_bpw) is not available for this model")
            if isinstance(layout, models.StackLayout):
                routing.watch(layer.get_submodule(name.rpartition(".")[0]), f"{base}.{name}", module)
                handles.append(module.register_forward_hook(
                    _on_stack(sums, state, routing, f"{base}.{name}.weight", layout.num_experts), with_kwargs=True))
                continue

            def on_experts(mod, args, kwargs, out, name=name, layout=layout, base=base):
                hidden, index, weights = (list(args) + [kwargs.get(k) for k in
                                                        ("hidden_states", "top_k_index", "top_k_weights")
                                                        if k in kwargs])[:3]
                if out.requires_grad:
                    out.register_hook(lambda g: pending.append((mod, layout, f"{base}.{name}", hidden.detach(),
                                                                index.detach(), weights.detach(), g.detach(),
                                                                state["keep"])))
            handles.append(module.register_forward_hook(on_experts, with_kwargs=True))
    try:
        yield pending
    finally:
        for h in handles:
            h.remove()
        routing.close()


def _expert_sums(sums: _Sums, pending: list) -> None:
    """Adds the experts' squared gradients of one backward pass (see the module docstring)."""
    for module, layout, base, hidden, index, weights, g_out, keep in pending:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        g_out = g_out.reshape(-1, g_out.shape[-1]).float()
        tokens = torch.arange(hidden.shape[0], device=hidden.device)
        if keep is not None and keep.numel() == hidden.shape[0]:
            tokens = tokens[keep.to(hidden.device)]
        n_exp = layout.num_experts
        for e in range(n_exp):
            hit = (index[tokens] == e)
            rows = hit.any(-1)
            if not bool(rows.any()):
                continue
            tok = tokens[rows]
            w = (weights[tok].float() * hit[rows].float()).sum(-1, keepdim=True)
            g_y = w * g_out[tok]
            sums.add(f"{base}.down_proj", e, n_exp, float((g_y ** 2).sum()), g_y.numel())
            g_up = _gate_up_grad(module, layout, e, hidden[tok], g_y)
            sums.add(f"{base}.{layout.up_name}", e, n_exp, float((g_up ** 2).sum()), g_up.numel())
    pending.clear()


def draw_labels(logits: torch.Tensor, generator: torch.Generator, rows: int = 4096) -> torch.Tensor:
    """int64 (N,) labels drawn from the next-token distributions of float ``logits`` (N, V), ``rows`` at a time
    (the probabilities of a chunk go to host memory in float64, so the draws do not depend on the device)."""
    with torch.no_grad():
        out = [torch.multinomial(torch.softmax(chunk.detach().double(), -1).cpu(), 1, generator=generator)[:, 0]
               for chunk in logits.split(rows)]
    return torch.cat(out).to(logits.device)


def fisher_gains(model, batch_list, *, seed: int = 0, decoder=None) -> dict:
    """The gain of every target matrix of ``model``'s decoder layers (module docstring).

    Args:
      model: a transformers causal LM (float weights), where it was loaded.
      batch_list: :class:`jgptq_torch.pipeline.calib.Batch` es (``input_ids``, ``attention_mask``: padding is left out).
      seed: seed of the labels drawn from the model's next-token distribution.
      decoder: (prefix, decoder layers, their :class:`jgptq_torch.models.LayerTargets`) when the run found them
        already (default: found here, every target).
    Returns:
      model parameter name -> float64 numpy (count,): the mean squared gradient per output entry of each matrix
      of the parameter (count = experts, or 1), 0 for an expert no calibration token reached.
    """
    if decoder is None:
        prefix, layers = models.find_decoder_layers(model)
        decoder = prefix, layers, [models.layer_targets(layer) for layer in layers]
    prefix, layers, found = decoder
    emb = model.get_input_embeddings()
    device = emb.weight.device
    sums, state = _Sums(), {"keep": None}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    model.eval()

    def leaf(mod, args, out):   # gradients start at the embeddings' output; no parameter needs one
        return out.detach().requires_grad_(True)

    handle = emb.register_forward_hook(leaf)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        with _hooks(layers, found, prefix, sums, state) as pending, torch.enable_grad():
            for batch in batch_list:
                mask = batch.attention_mask.to(device)
                state["keep"] = mask.reshape(-1).to(torch.bool)
                logits = model(input_ids=batch.input_ids.to(device), attention_mask=mask, use_cache=False).logits
                flat = logits.reshape(-1, logits.shape[-1])
                labels = draw_labels(flat, generator)
                nll = torch.nn.functional.cross_entropy(flat.float(), labels, reduction="none")
                (nll * mask.reshape(-1).to(nll.dtype)).sum().backward()
                _expert_sums(sums, pending)
    finally:
        handle.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
    return sums.gains()
