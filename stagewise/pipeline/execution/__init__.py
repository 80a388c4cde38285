"""Running a rank's actions of a schedule: the executor, and the receives it posts ahead."""
