"""Memory accounting: probes, the live-tensor tracker, the budget and the guard."""
