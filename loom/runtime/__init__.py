"""The running job: process environment and rendezvous, hang detection, fault tolerance, restarts, stragglers,
preemption, the run dir's lock and the elastic launcher."""
