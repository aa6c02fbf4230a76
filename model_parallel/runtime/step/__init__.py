"""One step of one rank: the schedule as data, its actions run on the stage, the update, the loop."""
