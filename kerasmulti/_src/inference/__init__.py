"""Data-parallel batch inference over data larger than memory, into a resumable file."""
