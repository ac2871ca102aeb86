"""The model adapter: which blocks a stage holds, the stage's view of the container, and the step driver."""
