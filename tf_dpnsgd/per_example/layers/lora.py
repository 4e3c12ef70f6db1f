"""LoRA factors of ``Dense`` and ``EinsumDense``: per-example gradients as einsum kernel gradients.

With LoRA enabled (``layer.enable_lora(rank)``, Keras 3.15,
``keras/src/layers/core/dense.py`` and ``einsum_dense.py``) the layer's
``kernel`` property is the merged kernel

    ``K = W + s * matmul(A, B)``,  ``s = lora_alpha / lora_rank``,

with ``A`` of shape ``kernel.shape[:-1] + (r,)`` and ``B`` of shape
``(r, kernel.shape[-1])`` (``matmul`` contracts ``A``'s last axis with
``B``'s first), and ``call`` computes ``einsum(equation, x, K)`` (Dense:
``x K``). ``enable_lora`` freezes ``W`` (``layer._kernel.trainable = False``);
``A`` and ``B`` are trainable.

Per example ``i``, with ``G_i = dL_i/dK`` (the kernel gradient the Dense and
EinsumDense rules already factor, :func:`~.dense.einsum_kernel_representation`)
and ``k`` the kernel's last letter:

* ``dL_i/dA = s * sum_k G_i[..., k] B[:, k]``: for Dense
  ``s x^T (dz B^T)``, the activation/output-gradient pair ``(x, s dz B^T)``;
* ``dL_i/dB = s * sum_{...} A[..., :] G_i[..., k]``: for Dense
  ``(s x A)^T dz``, the pair ``(s x A, dz)``.

Both are again kernel gradients of an einsum of the layer's input (or output
gradient) with ``B`` (or ``A``) folded in, so each factor gets the same
representation as a kernel (:class:`~..factored.Outer`: ghost norm or
materialised, with the float64 certification; or materialised per example
where the equation has a per-position kernel axis). :func:`factor_gradients`
writes down those einsums; which tensor ``B`` is folded into depends on the
role of ``k``:

==============================  =================================  ===========================
``k`` in the equation           ``A``'s einsum                     ``B``'s einsum
==============================  =================================  ===========================
output only (``btd,dnh->btnh``  ``x, K'r -> out[k := r]`` with     ``u, rk -> out`` with
``btnh,nhd->btd``, Dense)       ``dz' = s einsum(dz, B)``           ``u = s einsum(x, A)``
input only (contracted)         ``x'[k := r], K'r -> out``         as above
input and output (per-position) ``x' r, K'r -> out`` (materialised) as above (materialised)
==============================  =================================  ===========================

(``K'`` the kernel letters but ``k``, ``r`` a fresh letter for the rank.)
``u`` keeps the output's axes that ``A`` produces, so ``B``'s gradient sums
over positions *and* those axes: e.g. ``btd,dnh->btnh`` gives ``B``
``(t, n)`` positions. A layer called several times (shared) gets one
representation per use and factor, merged by the engine like any kernel's.
"""

from __future__ import annotations

import dataclasses
import string

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class FactorGradient:
  """One LoRA factor's per-example gradient, as an EinsumDense kernel gradient.

  ``d loss_i / d variable = einsum(f"{inputs},{output}->{kernel}", x[i], dz[i])``
  for ``equation = f"{inputs},{kernel}->{output}"`` (batch letter first in
  ``inputs`` and ``output``, not in ``kernel``).

  Attributes:
    variable: ``layer.lora_kernel_a`` or ``layer.lora_kernel_b``.
    equation: the einsum whose kernel is ``variable``.
    x: ``[B, ...]`` float32 input of that einsum.
    dz: ``[B, ...]`` float32 gradient of the summed loss w.r.t. its output.
  """

  variable: object
  equation: str
  x: tf.Tensor
  dz: tf.Tensor


def scale(layer) -> float:
  """``lora_alpha / lora_rank``, the factor Keras multiplies ``A B`` by."""
  return layer.lora_alpha / layer.lora_rank


def base_kernel(layer):
  """The layer's own kernel variable ``W`` (``layer.kernel`` is ``W + s A B`` under LoRA)."""
  return layer._kernel  # pylint: disable=protected-access


def factor_gradients(layer, inputs: str, kernel: str, output: str, x, dz) -> list[FactorGradient]:
  """The einsums whose kernel gradients are the per-example gradients of ``A`` and ``B``.

  Args:
    layer: a LoRA-enabled ``Dense`` or ``EinsumDense``.
    inputs, kernel, output: the layer's einsum, ellipsis expanded (Dense:
      ``"abc", "cd", "abd"`` on inputs reshaped to ``[B, T, d_in]``).
    x: ``[B, ...]`` the layer's input (as the einsum sees it).
    dz: ``[B, ...]`` gradient of the summed loss w.r.t. ``einsum(x, K)``.

  Returns:
    ``[FactorGradient for A, FactorGradient for B]``.
  """
  r = next(c for c in string.ascii_letters if c not in inputs + kernel + output)
  s = scale(layer)
  a = tf.cast(layer.lora_kernel_a, tf.float32)
  b = tf.cast(layer.lora_kernel_b, tf.float32)
  x = tf.cast(x, tf.float32)
  dz = tf.cast(dz, tf.float32)
  head, last = kernel[:-1], kernel[-1]
  a_kernel = head + r
  if last not in inputs:  # produced: fold B into the output gradient
    out_a = output.replace(last, r)
    grad_a = FactorGradient(layer.lora_kernel_a, f"{inputs},{a_kernel}->{out_a}", x,
                            s * tf.einsum(f"{output},{r}{last}->{out_a}", dz, b))
  else:  # contracted (k := r) or per-position (r appended): fold B into the input
    in_a = inputs.replace(last, r) if last not in output else inputs + r
    grad_a = FactorGradient(layer.lora_kernel_a, f"{in_a},{a_kernel}->{output}",
                            s * tf.einsum(f"{inputs},{r}{last}->{in_a}", x, b), dz)
  # u = s x A keeps the batch, positions, per-position letters and k (if an input letter),
  # and the output letters A produces; A's contracted letters and input-only letters are summed.
  kept = [c for c in inputs if c in output or c == last]
  kept += [c for c in head if c in output and c not in kept]
  u_spec = "".join(kept) + r
  grad_b = FactorGradient(layer.lora_kernel_b, f"{u_spec},{r}{last}->{output}",
                          s * tf.einsum(f"{inputs},{a_kernel}->{u_spec}", x, a), dz)
  return [grad_a, grad_b]
