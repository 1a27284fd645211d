"""ZeRO stage managers: flat layout and ownership, gradient reduction, the shard optimizer, collectives."""
