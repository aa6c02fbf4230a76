"""The operator's requests to a running coordinator (`model-parallel ctl ...`): status, rebalance, set-plan, scale, slow.

Each request is one `ctl` message answered by one `reply` (`ok` with a JSON result, or the error's
text). Plan changes are refused while the run is stopping or while a switch is still in flight; a
request that cannot be carried out is a PlanError, which the client prints as one line.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Callable

from model_parallel.coordinator.protocol import ProtocolError, Session
from model_parallel.coordinator.rebalancer import Rebalancer, Send
from model_parallel.coordinator.solver import plan_for_workers
from model_parallel.coordinator.status import Roster
from model_parallel.errors import ModelParallelError, PlanError
from model_parallel.graph.plan import Plan
from model_parallel.messages import MAX_SLOWDOWN, Command

logger = logging.getLogger(__name__)

CTL_IDLE_TIMEOUT_S = 60.0


class CtlHandler:
    """Runs ctl requests against the coordinator's roster and rebalancer (under its lock)."""

    def __init__(self, lock: threading.RLock, roster: Roster, rebalancer: Rebalancer, send: Send,
                 status: Callable[[], dict[str, Any]]) -> None:
        self.lock, self.roster, self.rebalancer, self.send, self.status = lock, roster, rebalancer, send, status

    def serve(self, session: Session, where: str, shutdown: threading.Event) -> bool:
        """Answer one ctl client's requests until it hangs up (True) or breaks the protocol (ProtocolError)."""
        while not shutdown.is_set():
            try:
                message = session.recv(CTL_IDLE_TIMEOUT_S)
            except ConnectionError:
                return True
            if message["type"] != "ctl":
                raise ProtocolError(f"ctl client sent {message['type']!r}; expected ctl")
            logger.info("ctl %s from %s", message["op"], where)
            try:
                result = self.handle(message["op"], message["args"])
            except ModelParallelError as error:
                session.send("reply", ok=False, error=str(error))
                continue
            except Exception as error:  # noqa: BLE001 - a bad request must not kill the coordinator
                logger.exception("ctl %s from %s failed", message["op"], where)
                session.send("reply", ok=False, error=f"internal error: {type(error).__name__}: {error}")
                continue
            session.send("reply", ok=True, result=result)
        return True

    def handle(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """Run one ctl operation; returns its JSON result or raises a ModelParallelError."""
        with self.lock:
            if op == "status":
                return self.status()
            rebalancer, roster = self.rebalancer, self.roster
            if roster.stop_reason is not None:
                raise PlanError(f"the run is stopping ({roster.stop_reason}); no plan changes accepted")
            if rebalancer.pending is not None and op in ("rebalance", "set-plan", "scale"):
                raise PlanError(f"plan v{rebalancer.pending.plan.version} is still being applied; try again in a few steps")
            step = roster.step()
            if op == "rebalance":
                decision = rebalancer.decide(roster.workers, step, force=True)
                if decision.plan is None:
                    return {"switched": False, "reason": decision.reason}
                plan = self._issue(decision.plan, f"ctl rebalance: {decision.reason}", step, predicted=True)
                return {"switched": True, "version": plan.version, "reason": decision.reason, "plan": plan.to_dict()}
            if op == "set-plan":
                plan = self._check_plan(Plan.from_dict(args.get("plan"), "set-plan"))
                plan = self._issue(plan, "ctl set-plan", step)
                return {"switched": True, "version": plan.version, "plan": plan.to_dict()}
            if op == "scale":
                plan = self._scaled_plan(args.get("workers"))
                plan = self._issue(plan, f"ctl scale --workers {plan.num_stages}", step)
                return {"switched": True, "version": plan.version, "plan": plan.to_dict()}
            if op == "slow":
                rank, factor = args.get("rank"), args.get("factor")
                if not isinstance(rank, int) or isinstance(rank, bool) or rank not in roster.workers:
                    raise PlanError(f"slow: no worker with rank {rank!r}; running ranks are {sorted(roster.workers)}")
                if not isinstance(factor, (int, float)) or not 1.0 <= factor <= MAX_SLOWDOWN:
                    raise PlanError(f"slow --factor must be a number from 1 (back to normal) to {MAX_SLOWDOWN:g}, got {factor!r}")
                if not self.send(0, Command.slowdown(rank, float(factor), reason="ctl slow")):
                    raise PlanError("slow: rank 0 is not connected, so the slowdown cannot be broadcast")
                rebalancer.slowed(rank, roster.workers[rank].slowdown, float(factor))
                roster.workers[rank].slowdown = float(factor)
                return {"rank": rank, "factor": float(factor)}
        raise PlanError(f"unknown ctl op {op!r}")

    def _issue(self, plan: Plan, reason: str, step: int, predicted: bool = False) -> Plan:
        sent = self.rebalancer.issue(plan, reason, step, self.send, predicted,
                                     speeds=self.rebalancer.speeds(self.roster.workers))
        if sent is None:
            raise PlanError(f"{reason.split(':')[0]}: rank 0 is not connected, so the new plan cannot be broadcast; "
                            "try again once it is back")
        return sent

    def _check_plan(self, plan: Plan) -> Plan:
        """What set-plan adds to the workers' own rules (checked in `Rebalancer.issue`): all nodes, live ranks only."""
        if plan.num_ranks > self.rebalancer.world_size:  # before with_default_ranks allocates a rank per replica
            raise PlanError(f"set-plan: the plan places {plan.num_ranks} replica(s) but the job's world has "
                            f"{self.rebalancer.world_size} rank(s); replicas are bounded by the world size")
        plan = plan.with_default_ranks()
        graph = self.rebalancer.graph
        nodes = [n for s in plan.stages for n in s.node_ids]
        missing = sorted(set(graph.by_id) - set(nodes))
        extra = sorted(set(nodes) - set(graph.by_id))
        if missing or extra:
            raise PlanError(f"set-plan: the plan must cover the graph's {len(graph)} nodes exactly; "
                            f"missing {missing[:3]}, unknown {extra[:3]}")
        alive = self.roster.running()
        ranks = {r for s in plan.stages for r in s.ranks}
        if not ranks <= alive:
            raise PlanError(f"set-plan: the plan uses rank(s) {sorted(ranks - alive)} which are not running (running: {sorted(alive)})")
        return plan

    def _scaled_plan(self, count: Any) -> Plan:
        alive = sorted(self.roster.running())
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= len(alive):  # True is no count
            raise PlanError(f"scale --workers {count!r}: must be between 1 and the {len(alive)} running worker(s)")
        speeds = self.rebalancer.speeds(self.roster.workers)
        # Keep the fastest `count` workers (ties: lower rank), in rank order.
        chosen = sorted(sorted(alive, key=lambda r: (-speeds.get(r, 1.0), r))[:count])
        known = [speeds.get(r, 1.0) for r in chosen]
        state = self.rebalancer.state
        return plan_for_workers(state.graph, chosen, known, state.plan.version + 1, state.solver)
