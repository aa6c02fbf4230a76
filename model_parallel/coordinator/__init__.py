"""The control plane: wire protocol, coordinator server, worker/ctl clients and the rebalancing policy."""
from model_parallel.coordinator.client import CoordinatorChannel, CtlClient
from model_parallel.coordinator.policy import Decision, PolicyConfig, PolicyState, Samples, decide, estimate_speeds
from model_parallel.coordinator.server import Coordinator

__all__ = ["Coordinator", "CoordinatorChannel", "CtlClient", "Decision", "PolicyConfig", "PolicyState", "Samples", "decide",
           "estimate_speeds"]
