"""Built-in layer-wise rules; importing this package registers them.

=============================================  =================  ==================================
layer type                                     module             per-example norm of
=============================================  =================  ==================================
``keras.layers.Dense``                         :mod:`.dense`      kernel (ghost or materialised), bias
``keras.layers.EinsumDense``                   :mod:`.dense`      kernel (ghost or materialised), bias
``Dense`` / ``EinsumDense`` with LoRA          :mod:`.dense`,     ``lora_kernel_a``, ``lora_kernel_b``
                                               :mod:`.lora`       (as kernels), bias; not the frozen W
``keras.layers.Conv1D`` / ``Conv2D`` /         :mod:`.conv`       kernel from input patches (per group), bias
``Conv3D``
``keras.layers.DepthwiseConv1D`` /             :mod:`.conv_more`  kernel (materialised: one folded
``DepthwiseConv2D``                                               backprop-filter), bias
``keras.layers.SeparableConv1D`` /             :mod:`.conv_more`  depthwise kernel (as above),
``SeparableConv2D``                                               pointwise kernel (ghost or
                                                                  materialised), bias
``keras.layers.Conv1DTranspose`` /             :mod:`.conv_more`  kernel as a convolution of the
``Conv2DTranspose`` / ``Conv3DTranspose``                         output gradient (patches), bias
``keras.layers.Embedding``                     :mod:`.embedding`  rows gathered per example
``keras.layers.ReversibleEmbedding`` (also     :mod:`.embedding`  lookup rows, reverse projection,
keras-hub's)                                                      tied weights (exact cross term)
``keras_hub.layers.PositionEmbedding``         :mod:`.embedding`  the rows of the used positions
keras-hub ``RelativeEmbedding``                :mod:`.embedding`  table (materialised: each example's
(``DebertaV3Backbone``)                                           repeated copy), its norm's gamma, beta
``keras.layers.LayerNormalization``            :mod:`.normalization`  gamma, beta (materialised)
``keras.layers.GroupNormalization``            :mod:`.normalization`  gamma, beta (materialised)
``keras.layers.RMSNormalization`` (also        :mod:`.normalization`  scale (materialised); Gemma's
keras-hub's ``LlamaLayerNorm``,                                   output is ``xhat * (1 + scale)``
``MistralLayerNormalization``, Gemma's
``RMSNormalization``)
``keras.layers.PReLU``                         :mod:`.activation`  alpha (materialised)
``keras.layers.SimpleRNN`` / ``LSTM`` /        :mod:`.recurrent`  kernel, recurrent kernel (ghost or
``GRU``; ``RNN`` of a ``SimpleRNNCell`` /                          materialised, sums over time of
``LSTMCell`` / ``GRUCell`` (so also in                             outer products), bias; dropout 0,
``Bidirectional``)                                                 not stateful
keras-hub ``ViTPatchingAndEmbedding``          :mod:`.vision`     patch kernel (``Conv2D`` rule), bias,
(``ViTBackbone``)                                                 class token, position rows
=============================================  =================  ==================================

Composite layers without variables of their own (``MultiHeadAttention``,
keras-hub's ``TransformerEncoder``, ``TokenAndPositionEmbedding``,
``Bidirectional``, functional sub-models and backbones) need no rule: the
engine visits their sublayers.
"""

from tf_dpnsgd.per_example.layers import (activation, conv, conv_more, dense, embedding, lora,
                                          normalization, recurrent, vision)

__all__ = ["activation", "conv", "conv_more", "dense", "embedding", "lora", "normalization",
           "recurrent", "vision"]
