"""The outbox store: reading batches, consumer positions, leadership and operator queries."""
