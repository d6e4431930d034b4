"""The shared core both sides use: named kinds, errors, the trigger, RNG, numerics helpers, file and runtime utilities,
the adapters to other libraries' private members, tracker uploads."""
