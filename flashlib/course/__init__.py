"""What the notebooks need beyond the algorithms: figures, widgets, exercise checkers.

    viz               every figure, in one visual language (the colours mean the same everywhere)
    widgets           the sliders that step through online softmax and the tiles
    exercises         checkers of notebooks 01-04; kernel_exercises 05-07; perf_exercises 08
    training          the tiny model notebook 07 trains with each attention
    inference, ring   notebooks 10 and 11: their figures, sliders and checkers
    runtime           what a runtime has and what of the course runs there: the notebooks' setup line

The labs, where the learner writes the algorithm, are a room of their own: flashlib.labs.
"""
