"""Background work: adapter validation, prefetch into the engine, keeping busy adapters warm, rollups.

Tasks take ids, check first whether their work is already done (a redelivery is harmless), and are sent
only after the database commit that makes their input visible.
"""
