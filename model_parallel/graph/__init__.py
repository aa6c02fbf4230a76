"""The operator graph, the plan and the machine hierarchy: the data model every step shares."""
from model_parallel.graph.core import Graph, LayerSpec, Node, TensorMeta
from model_parallel.graph.io import load_graph, save_graph
from model_parallel.graph.hierarchy import Hierarchy, Level
from model_parallel.graph.plan import Plan, StagePlan, read_plan, write_plan

__all__ = [
    "Graph", "LayerSpec", "Node", "TensorMeta", "Hierarchy", "Level", "Plan", "StagePlan",
    "load_graph", "save_graph", "read_plan", "write_plan",
]
