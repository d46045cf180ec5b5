"""Model parallelism: layers placed on devices, saved in files plain Keras loads."""
