"""
PyTorch: a training loop with a feature-redraw schedule
=======================================================

Random-feature attention (:func:`xattn.rfa`) approximates softmax attention with ``S``
random samples :math:`\\omega_s` (the rows of ``omega``). During training, the common
practice (Performer) is to **redraw** the features every few steps, so that the model
does not fit itself to one particular draw; at evaluation time the features are **fixed**
so that predictions are deterministic.

Passing ``omega`` explicitly is how xattn gives you this control: the same ``omega``
gives the same output, and a new one is just a new ``(S, D)`` Gaussian matrix. Here a
small single-head attention layer with RFA learns to imitate a "teacher" layer that uses
exact softmax attention, and ``omega`` is redrawn every ``redraw_every`` steps.
"""

# %%
import matplotlib.pyplot as plt
import torch

import xattn

torch.manual_seed(0)
batch, num_tokens, model_dim, head_dim, num_features = 8, 32, 16, 16, 64
steps, redraw_every = 100, 10


class Attention(torch.nn.Module):
    """One attention head; ``omega=None`` means exact softmax attention."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(model_dim, head_dim, bias=False)
        self.k = torch.nn.Linear(model_dim, head_dim, bias=False)
        self.v = torch.nn.Linear(model_dim, head_dim, bias=False)

    def forward(self, x, omega=None):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if omega is None:
            return xattn.softmax_attention(q, k, v)
        return xattn.rfa(q, k, v, omega=omega)


teacher, student = Attention(), Attention()
teacher.requires_grad_(False)
optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)

# A torch.Generator of its own keeps the feature draws reproducible and independent of
# the global seed used for the data and the initialization.
feature_generator = torch.Generator().manual_seed(1)


def draw_omega():
    return torch.randn(num_features, head_dim, generator=feature_generator)


# %%
# The loop: a fresh batch every step, new features every ``redraw_every`` steps.
losses = []
for step in range(steps):
    if step % redraw_every == 0:
        omega = draw_omega()
    x = torch.randn(batch, num_tokens, model_dim)
    loss = torch.mean((student(x, omega) - teacher(x)) ** 2)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"training loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")

# %%
# Evaluation
# ----------
# Fix one ``omega`` for evaluation: the same features give exactly the same outputs, so
# evaluation is deterministic. A larger ``S`` at evaluation time lowers the variance.
student.eval()
x_eval = torch.randn(64, num_tokens, model_dim)
eval_omega = torch.randn(4 * num_features, head_dim, generator=feature_generator)
with torch.no_grad():
    first = student(x_eval, eval_omega)
    second = student(x_eval, eval_omega)
    eval_loss = torch.mean((first - teacher(x_eval)) ** 2).item()
print("deterministic with a fixed omega:", torch.equal(first, second))
print(f"evaluation loss with {4 * num_features} fixed features: {eval_loss:.4f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.semilogy(losses, lw=1, label="training loss")
for redraw in range(0, steps, redraw_every):
    ax.axvline(redraw, color="0.85", lw=0.8, zorder=0)
ax.axhline(eval_loss, color="C1", ls="--", label="evaluation, fixed omega")
ax.set_xlabel("step (grey lines: omega redrawn)")
ax.set_ylabel("MSE to the softmax teacher")
ax.legend()
fig.tight_layout()
