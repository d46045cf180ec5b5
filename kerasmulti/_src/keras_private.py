"""Every private Keras and TensorFlow name kerasmulti imports, in one place.

kerasmulti owns its training step, so it reaches into Keras where no public
name does the job. Each import below says what it is for and why no public
name serves; where Keras has a public name (`keras.utils.unpack_x_y_sample_weight`,
`keras.StatelessScope`, `keras.backend.epsilon`), the code uses that instead.
`tests/test_private.py` checks every name here still exists with the
signature kerasmulti calls it with, so a Keras or TensorFlow release that
moves one fails that test by name instead of changing behaviour silently.
The versions these were read from are the ones `setup.cfg` pins.

Patches of Keras objects (the loss reduction in `_losses.py`, saving in
`_portable.py`, the layer call in `_device_scope.py`, BatchNormalization in
`_replicas.py`) live with the feature they serve; what they patch is
imported from here or is a public class.
"""

# Builds a model's variables (and Keras' compiled loss) symbolically, as
# Keras does before a step under a distribution strategy (`_symbolic_build`).
# Public `Layer.compute_output_spec` calls `call` directly and skips Keras'
# own argument handling (`training=` on models whose call does not take it).
from keras.src.backend import compute_output_spec

# A tensor's Keras mask travels as an attribute the public API neither reads
# nor writes; replica outputs are merged with theirs.
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

# Whether a layer call is in progress (Keras' call context): a loss computed
# inside a layer (add_loss) is not a replica's part of the batch's loss.
from keras.src.backend.common import global_state

# Keras' loss module: `reduce_weighted_values` is the one function every Keras
# loss reduces through, so a replica's share of the batch's loss is patched in
# there (`_losses.py`); the other helpers are the ones that function uses.
from keras.src.losses import loss as loss_module

# Keras' own test of whether a model can run under XLA (`jit_compile="auto"`).
from keras.src.trainers.trainer import model_supports_jit

# Keras' array pipeline (batches, shuffling, class weights, validation split)
# with tf.data autotuning off (`_feeding.py`); `fit` builds it only internally.
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing

# Keras' shared-object bookkeeping of one save or load (OnDevice writes a
# layer wrapped several times once) also lives in `global_state`.

# Keras' saving entry points: `model.save` / `load_model` / `load_weights`
# all go through them, so a placed model is written as a plain one there
# (`_portable.py`); Keras has no public hook around saving.
from keras.src.saving import saving_lib

# A functional model's graph, read node by node (`_rebuild.py`,
# `_summary.py`): Keras exposes no public node API; the key says whether a
# layer's call belongs to this model.
from keras.src.models.functional import Functional
from keras.src.ops.function import make_node_key

# Not imports but private attributes of a Keras optimizer: multi-worker
# gradient accumulation (`_accumulation.py`) re-runs Keras' accumulating
# `apply` with its synchronisation outside the `cond` that crashes under
# MultiWorkerMirroredStrategy (keras-team/keras#20582), on the optimizer's own
# state so that its checkpoints and iterations are Keras': `_iterations`,
# `_accumulated_gradients`, `_get_variable_index`, `_filter_empty_gradients`,
# `_clip_gradients`, `_use_weight_decay`. No public name reaches the
# accumulators or Keras' clipping and weight-decay rules. (Listed here for
# `tests/test_private.py`; they are attributes, not names in `__all__`.)
OPTIMIZER_ATTRIBUTES = (
    "_iterations",
    "_accumulated_gradients",
    "_get_variable_index",
    "_filter_empty_gradients",
    "_clip_gradients",
    "_use_weight_decay",
)

# Likewise attributes of Keras' LossScaleOptimizer (mixed precision) that
# `_accumulation.py` runs its skip-or-apply and rescaling with, around the
# accumulation, since its own `apply` calls the inner optimizer's, which
# crashes: the scale and the count of finite steps are its state, undocumented
# (no underscore, but no public API), as is `check_finite`.
LOSS_SCALE_ATTRIBUTES = ("inner_optimizer", "dynamic_scale", "step_counter", "dynamic_growth_steps", "check_finite")

# Joining a cluster with a deadline (`_cluster._join`): the coordination
# service is what MultiWorkerMirroredStrategy configures itself, but without
# `cluster_register_timeout_in_ms` a missing worker blocks for an hour.
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import multi_worker_util

# TensorFlow's runtime context: whether it started (a forked launch cannot use
# it then) and its coordination service. No public name tells either.
from tensorflow.python.eager import context as eager_context

# Whether a GradientTape is recording: a user's tape cannot see replicas that
# run on threads of their own. TensorFlow has no public way to ask.
from tensorflow.python.eager import record

__all__ = [
    "Functional",
    "array_data_adapter",
    "array_slicing",
    "compute_output_spec",
    "coordination_config_pb2",
    "eager_context",
    "get_keras_mask",
    "global_state",
    "loss_module",
    "make_node_key",
    "model_supports_jit",
    "multi_worker_util",
    "record",
    "saving_lib",
    "set_keras_mask",
]
