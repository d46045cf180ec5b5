"""Training across worker processes on `tf.distribute`, and the launcher that starts them."""
