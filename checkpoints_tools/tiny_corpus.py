"""A short English corpus, written for this project, that trains the demo model's tokenizer.

It only needs to be varied enough for a byte-level BPE to learn common English pieces; the
demo model's weights are random, so the text never shapes what the model says.
"""

TINY_CORPUS = """\
The capital of France is Paris, a city on the river Seine. Many people visit it every year to
see the museums, the old bridges and the small cafes along the narrow streets. In the morning
the bakeries open early and the smell of fresh bread fills the air.

Once upon a time there was a little fox who lived at the edge of a quiet forest. Every day the
fox walked to the river to drink water and to watch the fish jump. One winter the river froze,
and the fox learned to slide across the ice, laughing as the snow fell around him.

Machine learning is the study of programs that improve with experience. A language model reads
a sequence of tokens and predicts the next one. Training adjusts millions of numbers, called
weights, so that the predictions match the text it has seen. Inference runs the trained model
to generate new text, one token at a time, while a cache keeps the keys and values of earlier
tokens so they are not computed again.

The weather today is cloudy with a chance of rain in the afternoon. Tomorrow will be warmer and
sunny, with a light wind from the south. Farmers are happy because the fields need water after
a long dry summer, and the gardens in town are green again.

To make a simple soup, chop two onions, three carrots and a few potatoes. Cook the onions in a
little oil until they are soft, then add the other vegetables and enough water to cover them.
Let the pot simmer for half an hour, season it with salt and pepper, and serve it hot with
bread. Children often ask for a second bowl.

Scientists measure the speed of light very precisely: it travels about three hundred thousand
kilometres every second. Sound is much slower, which is why we see lightning before we hear
the thunder. Counting the seconds between the flash and the sound tells you how far away the
storm is.

The library was quiet except for the turning of pages. On the long wooden tables students read
about history, mathematics, music and art. An old man in the corner wrote letters to his
grandchildren, and a young woman studied maps of distant mountains she hoped to climb.

Numbers tell stories too: one, two, three, four, five, six, seven, eight, nine, ten. A hundred
years ago most people travelled by train or by horse; today airplanes cross oceans in a few
hours, and computers in our pockets answer questions in less than a second.

Good software is written for people first and machines second. Clear names, small functions
and careful tests help a team understand a program months after it was written. When a bug
appears, a good engineer reads the error message, forms a hypothesis, and checks it with an
experiment before changing any code.

The market on Saturday was full of colour: red tomatoes, yellow lemons, green peppers, purple
grapes and orange pumpkins. Traders called out their prices, and families walked slowly between
the stalls, tasting cheese, buying flowers, and talking with their neighbours about the week.

In the evening the city lights came on one by one. Trains carried workers home, restaurants
filled with friends sharing dinner, and somewhere a musician played a slow song on a piano
while the moon rose above the rooftops and the river reflected its silver light.
"""
