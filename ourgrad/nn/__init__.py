"""Neural-network building blocks: layers (this module), `functional` ops, `optim`, `state`."""
