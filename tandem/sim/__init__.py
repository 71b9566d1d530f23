"""`tandem sim`: the real engine loop, scheduler, block allocator, radix cache and routing
policies on a virtual clock, with step times from the cost model (fitted on this machine, or
derived from an accelerator's published figures). Imports no torch."""
