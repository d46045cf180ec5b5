"""Small helpers with no Keras in them: atomic writes, machine load, fault points, argument checks, patches."""
