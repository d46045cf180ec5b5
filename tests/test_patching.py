"""`patched`: functions set on single objects for a block, nested blocks included (no TensorFlow)."""

import pytest

from kerasmulti._src.utils.patching import patched


class Context:
    def all_reduce(self):
        return "class"


def test_nested_patches_of_one_attribute_put_back_the_outer_one_then_the_class_one():
    context, other = Context(), Context()
    with patched([(context, "all_reduce", lambda: "outer")]):
        with patched([(context, "all_reduce", lambda: "inner")]):
            assert context.all_reduce() == "inner"
        assert context.all_reduce() == "outer"
        assert other.all_reduce() == "class"  # the object's, never its class's
    assert context.all_reduce() == "class" and "all_reduce" not in vars(context)


def test_an_error_inside_still_puts_everything_back():
    context = Context()
    context.given = "own"
    with pytest.raises(KeyError), patched([(context, "all_reduce", lambda: "patched"), (context, "given", "patched")]):
        raise KeyError("inside")
    assert context.all_reduce() == "class" and context.given == "own"
