"""Layer-wise rules for Keras' recurrent layers: ``SimpleRNN``, ``LSTM``, ``GRU``, ``RNN(cell)``.

Every gate pre-activation of these cells is ``z_t = x_t W + h_{t-1} U + b``
(GRU: see below), so each weight's per-example gradient is a sum over time
of outer products, the structure of a ``Dense`` layer applied over a
sequence (:class:`~..factored.Outer`, ghost or materialised norm):

=====================  ===============================================================
variable               per-example gradient (``dz_t``: gradient of the summed loss
                       w.r.t. the gate pre-activations at step ``t``)
=====================  ===============================================================
``kernel``             ``sum_t x_t (x) dz_t``
``recurrent_kernel``   ``sum_t h_{t-1} (x) dz_t``
``bias``               ``sum_t dz_t``
=====================  ===============================================================

The rule recomputes the recurrence itself (:func:`run_recurrence`, one
``tf.scan`` over time with the cell's own weights and activations, each step
the ops of the cell's ``call`` in their order, so it rounds as the layer
does), in the order Keras' TensorFlow backend runs it (``keras.layers.RNN``
with ``backend.rnn``): ``go_backwards`` reverses the inputs and mask and
returns the outputs in processing order; a masked step keeps the states and
repeats the previous output (zeros before the first step, or always zeros
with ``zero_output_for_mask``); ``return_sequences``, ``return_state`` and
``initial_state`` as in Keras. A probed tensor of zeros ``eps [B, T, k]`` is
added to every step's input projection ``x_t W (+ b)`` (which changes no
value): since every gate pre-activation is that projection plus a recurrent
part, the gradient of ``eps`` is ``dz_t`` for every step at once, with zeros
on masked steps (the step's result is discarded by ``tf.where``). The
per-step states come out of the scan, so ``h_{t-1}`` needs no second pass.

GRU (``h = z h_{t-1} + (1 - z) tanh(x_h + ...)``) needs its reset gate ``r_t``
(recorded by the scan):

* ``reset_after=True`` (Keras' default): the recurrent pre-activation is
  ``rz = h_{t-1} U + b_rec`` and the candidate's is ``x_h + r * rz_h``
  (``x_h``: the input projection), so ``d rz = [dz_z, dz_r, r * dz_h]``: ``recurrent_kernel`` gets
  ``sum_t h_{t-1} (x) d rz_t``, and the bias (``[2, 3 units]``) the rows
  ``sum_t dz_t`` (input) and ``sum_t d rz_t`` (recurrent).
* ``reset_after=False``: the candidate is ``x_h + (r * h_{t-1}) U_h``, so the
  update/reset columns of ``U`` see ``h_{t-1}`` and the candidate columns see
  ``r_t * h_{t-1}``. One :class:`~..factored.Outer` still holds both exactly,
  over ``2 T`` positions: ``(h_{t-1}, [dz_z, dz_r, 0])`` and
  ``(r_t h_{t-1}, [0, 0, dz_h])``.

The cuDNN kernels Keras uses for ``LSTM``/``GRU`` on a GPU are not used: the
rule runs the loop itself everywhere (on a CPU, Keras runs the same loop).

Not handled (the layer's variables count as uncovered, so ``"auto"`` picks
another engine and ``"layerwise"`` names the reason): ``dropout`` or
``recurrent_dropout > 0`` (Keras draws its masks inside the cell),
``stateful=True``, cells other than ``SimpleRNNCell``, ``LSTMCell`` and
``GRUCell`` (e.g. ``StackedRNNCells``, ``ConvLSTM*``), LoRA/quantized/remat
layers. ``keras.layers.Bidirectional`` needs no rule of its own: Keras'
TensorFlow backend has no fused bidirectional kernel (it raises
``NotImplementedError`` and Keras calls the forward and backward layers), so
the engine routes those two layers' calls to this rule. Were a backend to
fuse them, the variables would be read outside their layers' calls, which
:func:`~tf_dpnsgd.per_example.layerwise.check_variable_uses` refuses on the
traced graph.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from tf_dpnsgd.per_example import factored
from tf_dpnsgd.per_example import registry as registry_lib

#: Cell types the rule recomputes, by kind.
_CELL_KINDS = {keras.layers.SimpleRNNCell: "simple", keras.layers.LSTMCell: "lstm",
               keras.layers.GRUCell: "gru"}

#: Number of gates (column blocks of the kernels) per kind.
_GATES = {"simple": 1, "lstm": 4, "gru": 3}


def cell_kind(layer) -> str | None:
  """``"simple"``, ``"lstm"`` or ``"gru"`` for a layer whose cell the rule recomputes, else None."""
  return _CELL_KINDS.get(type(getattr(layer, "cell", None)))


def _rnn_variables(layer):
  cell = layer.cell
  return [cell.kernel, cell.recurrent_kernel, cell.bias]


def _rnn_unsupported(layer):
  cell = getattr(layer, "cell", None)
  if cell_kind(layer) is None:
    return (f"its cell is a {type(cell).__name__}; the recurrent rule recomputes "
            "SimpleRNNCell, LSTMCell and GRUCell only")
  why = registry_lib.common_unsupported(layer) or registry_lib.common_unsupported(cell)
  if why:
    return why
  if layer.stateful:
    return "stateful=True (its states carry over between batches, i.e. between examples)"
  if cell.dropout or cell.recurrent_dropout:
    return (f"dropout={cell.dropout}, recurrent_dropout={cell.recurrent_dropout}: Keras draws "
            "these masks inside the cell, which the rule does not repeat (use 0, or "
            "per_example='microbatch')")
  return None


def _split_bias(cell, kind):
  """``(input bias, recurrent bias)``; the recurrent one only for GRU with ``reset_after``."""
  if cell.bias is None:
    return None, None
  if kind == "gru" and cell.reset_after:
    return cell.bias[0], cell.bias[1]
  return cell.bias, None


def _step_function(kind, cell):
  """``step(states, x_t, eps_t) -> (new_states, output, recorded)``: one step of ``cell``.

  The ops and their order are those of the cell's own ``call`` (Keras 3.15,
  ``implementation`` 1 and 2, dropout 0), so that the recomputed forward pass
  rounds as the layer's does; ``eps_t`` (zeros, probed) is added to the input
  projection ``x_t W (+ b)`` where Keras finishes it (adding 0 changes nothing),
  and its gradient is the gate pre-activations' ``dz_t``. ``states`` is ``(h,)``
  or ``(h, c)`` (LSTM); ``recorded`` is ``(r_t,)`` for GRU.
  """
  act, units = cell.activation, cell.units
  kernel = ops.convert_to_tensor(cell.kernel)
  recurrent_kernel = ops.convert_to_tensor(cell.recurrent_kernel)
  input_bias, recurrent_bias = _split_bias(cell, kind)
  if input_bias is not None:
    input_bias = ops.convert_to_tensor(input_bias)
  if recurrent_bias is not None:
    recurrent_bias = ops.convert_to_tensor(recurrent_bias)

  if kind == "simple":  # SimpleRNNCell.call
    def step(states, x_t, eps_t):
      h = ops.matmul(x_t, kernel)
      if input_bias is not None:
        h = ops.add(h, input_bias)
      output = act(h + eps_t + ops.matmul(states[0], recurrent_kernel))
      return (output,), output, ()
    return step

  ract = cell.recurrent_activation
  split = cell.implementation == 1  # one matmul per gate

  def gate_inputs(x_t, eps_t, gates):
    """``x_t W_g (+ b_g) + eps_g`` per gate (implementation 1)."""
    ks = ops.split(kernel, gates, axis=1)
    bs = ops.split(input_bias, gates, axis=0) if input_bias is not None else [None] * gates
    es = ops.split(eps_t, gates, axis=-1)
    out = []
    for k, b, e in zip(ks, bs, es):
      v = ops.matmul(x_t, k)
      if b is not None:
        v += b
      out.append(v + e)
    return out

  if kind == "lstm":  # LSTMCell.call
    def step(states, x_t, eps_t):
      h_tm1, c_tm1 = states
      if split:
        x_i, x_f, x_c, x_o = gate_inputs(x_t, eps_t, 4)
        u = recurrent_kernel
        i = ract(x_i + ops.matmul(h_tm1, u[:, :units]))
        f = ract(x_f + ops.matmul(h_tm1, u[:, units:units * 2]))
        c = f * c_tm1 + i * act(x_c + ops.matmul(h_tm1, u[:, units * 2:units * 3]))
        o = ract(x_o + ops.matmul(h_tm1, u[:, units * 3:]))
      else:
        z = ops.matmul(x_t, kernel) + eps_t
        z = ops.add(z, ops.matmul(h_tm1, recurrent_kernel))
        if input_bias is not None:
          z = ops.add(z, input_bias)
        z0, z1, z2, z3 = ops.split(z, 4, axis=1)
        i, f, o = ract(z0), ract(z1), ract(z3)
        c = f * c_tm1 + i * act(z2)
      h = o * act(c)
      return (h, c), h, ()
    return step

  def step(states, x_t, eps_t):  # GRUCell.call
    (h_tm1,) = states
    u = recurrent_kernel
    if split:
      x_z, x_r, x_h = gate_inputs(x_t, eps_t, 3)
      recurrent_z = ops.matmul(h_tm1, u[:, :units])
      recurrent_r = ops.matmul(h_tm1, u[:, units:units * 2])
      if cell.reset_after and recurrent_bias is not None:
        recurrent_z += recurrent_bias[:units]
        recurrent_r += recurrent_bias[units:units * 2]
      z = ract(x_z + recurrent_z)
      r = ract(x_r + recurrent_r)
      if cell.reset_after:
        recurrent_h = ops.matmul(h_tm1, u[:, units * 2:])
        if recurrent_bias is not None:
          recurrent_h += recurrent_bias[units * 2:]
        recurrent_h = r * recurrent_h
      else:
        recurrent_h = ops.matmul(r * h_tm1, u[:, units * 2:])
    else:
      matrix_x = ops.matmul(x_t, kernel)
      if input_bias is not None:
        matrix_x = ops.add(matrix_x, input_bias)
      x_z, x_r, x_h = ops.split(matrix_x + eps_t, 3, axis=-1)
      if cell.reset_after:
        matrix_inner = ops.matmul(h_tm1, u)
        if recurrent_bias is not None:
          matrix_inner += recurrent_bias
      else:
        matrix_inner = ops.matmul(h_tm1, u[:, :2 * units])
      z = ract(x_z + matrix_inner[:, :units])
      r = ract(x_r + matrix_inner[:, units:units * 2])
      if cell.reset_after:
        recurrent_h = r * matrix_inner[:, units * 2:]
      else:
        recurrent_h = ops.matmul(r * h_tm1, u[:, 2 * units:])
    hh = act(x_h + recurrent_h)
    h = z * h_tm1 + (1 - z) * hh
    return (h,), h, (r,)
  return step


def run_recurrence(step, x, eps, initial_states, mask=None, zero_output_for_mask=False,
                   num_recorded=0):
  """Runs ``step`` over the time axis as Keras' TensorFlow ``backend.rnn`` does.

  Args:
    step: from :func:`_step_function`.
    x: ``[B, T, d]`` inputs in processing order.
    eps: ``[B, T, k]`` zeros (the probe) in processing order.
    initial_states: tuple of ``[B, units]``.
    mask: optional ``[B, T]`` bool in processing order: a False step keeps
      the states and outputs the previous output (zeros before the first
      step), or zeros with ``zero_output_for_mask``.
    num_recorded: how many tensors ``step`` records per step.

  Returns:
    ``(states, outputs, recorded)``: the states after each step (tuple of
    ``[T, B, units]``), the outputs ``[T, B, units]`` and the recorded tensors
    (tuple of ``[T, B, units]``), all time-major.
  """
  elems = (tf.transpose(x, [1, 0, 2]), tf.transpose(eps, [1, 0, 2]))
  if mask is not None:
    elems += (tf.transpose(tf.cast(mask, tf.bool))[:, :, None],)
  zeros = tf.zeros_like(initial_states[0])

  def body(acc, elem):
    states, previous, _ = acc
    new_states, output, recorded = step(states, elem[0], elem[1])
    if mask is not None:
      keep = elem[2]
      output = tf.where(keep, output, zeros if zero_output_for_mask else previous)
      new_states = tuple(tf.where(keep, n, o) for n, o in zip(new_states, states))
    return tuple(new_states), output, tuple(recorded)

  initializer = (tuple(initial_states), zeros, tuple(zeros for _ in range(num_recorded)))
  return tf.scan(body, elems, initializer=initializer)


def _initial_states(layer, kind, initial_state, sequences):
  count = 2 if kind == "lstm" else 1
  dtype = layer.cell.compute_dtype
  if initial_state is None:
    shape = tf.stack([tf.shape(sequences)[0], layer.cell.units])
    return tuple(tf.zeros(shape, dtype) for _ in range(count))
  if not isinstance(initial_state, (list, tuple)):
    initial_state = [initial_state]
  if len(initial_state) != count:
    raise registry_lib.UnsupportedLayerError(
        f"{type(layer).__name__} '{layer.name}' got {len(initial_state)} initial states; "
        f"its cell has {count}.")
  return tuple(ops.cast(s, dtype) for s in initial_state)


def _time_major_to_batch(t):
  return tf.transpose(t, [1, 0, 2])


def _recurrent_kernel_rep(kind, cell, h_prev, dz, recorded):
  """``(representation of recurrent_kernel, d rz or None)``; ``[B, T, ...]`` inputs."""
  units = cell.units
  q = _GATES[kind] * units
  if kind != "gru":
    return factored.Outer(h_prev, dz, [units], [q]), None
  r = tf.cast(_time_major_to_batch(recorded[0]), tf.float32)
  d_zr, d_h = dz[..., :2 * units], dz[..., 2 * units:]
  if cell.reset_after:
    drz = tf.concat([d_zr, r * d_h], axis=-1)
    return factored.Outer(h_prev, drz, [units], [q]), drz
  # U_zr sees h_{t-1}, U_h sees r_t * h_{t-1}: 2T positions, each feeding its own columns.
  a = tf.concat([h_prev, r * h_prev], axis=1)
  b = tf.concat([tf.concat([d_zr, tf.zeros_like(d_h)], axis=-1),
                 tf.concat([tf.zeros_like(d_zr), d_h], axis=-1)], axis=1)
  return factored.Outer(a, b, [units], [q]), None


def _rnn_capture(layer, call, args, kwargs, probe):
  """Repeats ``keras.layers.RNN.call`` for a Simple/LSTM/GRU cell, ``dz`` read off a zero probe."""
  arguments = registry_lib.bind_call_arguments(call, args, kwargs)
  sequences = ops.convert_to_tensor(arguments["sequences"])
  mask = arguments.get("mask")
  if isinstance(mask, (list, tuple)):
    mask = mask[0]
  cell = layer.cell
  kind = cell_kind(layer)
  states0 = _initial_states(layer, kind, arguments.get("initial_state"), sequences)
  x = sequences
  if layer.go_backwards:
    x = tf.reverse(x, [1])
    mask = tf.reverse(mask, [1]) if mask is not None else None
  gates = _GATES[kind] * cell.units
  shape = tf.concat([tf.shape(x)[:2], [gates]], axis=0)
  eps = probe(factored.runtime_zeros(shape, cell.compute_dtype))  # [B, T, k]: its grad is dz
  states, outputs, recorded = run_recurrence(
      _step_function(kind, cell), x, eps, states0, mask, layer.zero_output_for_mask,
      num_recorded=int(kind == "gru"))

  def finish(grads):
    (dz,) = grads
    dz = tf.cast(dz, tf.float32)
    units, d_in = cell.units, cell.kernel.shape[0]
    h_seq = states[0]
    h_prev = tf.concat([states0[0][None], h_seq[:-1]], axis=0)  # the state entering each step
    h_prev = tf.cast(_time_major_to_batch(h_prev), tf.float32)
    q = _GATES[kind] * units
    out = [(cell.kernel, factored.Outer(tf.cast(x, tf.float32), dz, [d_in], [q]))]
    recurrent, drz = _recurrent_kernel_rep(kind, cell, h_prev, dz, recorded)
    out.append((cell.recurrent_kernel, recurrent))
    if cell.bias is not None:
      bias = tf.reduce_sum(dz, axis=1)
      if drz is not None:
        bias = tf.stack([bias, tf.reduce_sum(drz, axis=1)], axis=1)
      out.append((cell.bias, factored.Materialized(bias)))
    return out

  dtype = layer.compute_dtype
  output = _time_major_to_batch(outputs) if layer.return_sequences else outputs[-1]
  output = ops.cast(output, dtype)
  if layer.return_state:
    return (output,) + tuple(ops.cast(s[-1], dtype) for s in states), finish
  return output, finish


RNN_RULE = registry_lib.LayerRule(variables=_rnn_variables, capture=_rnn_capture,
                                  unsupported=_rnn_unsupported)

for _layer_type in (keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU,
                    keras.layers.RNN):
  registry_lib.DEFAULT_REGISTRY.register(_layer_type, RNN_RULE)
