"""Movement ops without data movement: symbolic index math (`symbolic`), strided masked `View`s, `ShapeTracker`.

Exports ShapeTracker, View and the symbolic node types/constructors.
"""
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import (AndNode, DivNode, LtNode, ModNode, MulNode, Node, NumNode, SumNode, Variable,
                                    sym_and, sym_int, sym_sum)
from ourgrad.shape.view import View, merge_dims, strides_for_shape

__all__ = ["ShapeTracker", "View", "strides_for_shape", "merge_dims", "Node", "Variable", "NumNode", "MulNode",
           "DivNode", "ModNode", "SumNode", "LtNode", "AndNode", "sym_sum", "sym_and", "sym_int"]
