"""Keras callbacks for parallel models: atomic checkpoints of the template, exact backups."""
