//! Stop strings over streamed text: text is released only once it can no longer turn out to be
//! the start of a stop string, so a stream never shows a stop string it then has to take back.

/// Tracks generated text against the stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    released: usize,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher {
            stops,
            ..StopMatcher::default()
        }
    }

    /// Adds generated text; returns the text now safe to show and whether a stop string ended
    /// the output (the stop string itself is never released).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        let search_from = self.released;
        self.text.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter_map(|stop| {
                self.text[search_from..]
                    .find(stop.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(end) = hit {
            self.text.truncate(end);
            self.stopped = true;
            return (self.release_to(end), true);
        }
        let held = self.longest_partial_stop();
        (self.release_to(self.text.len() - held), false)
    }

    /// Releases whatever is still held back (the output ended without a stop string).
    pub fn finish(&mut self) -> String {
        self.release_to(self.text.len())
    }

    /// The whole output so far, without any stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn release_to(&mut self, end: usize) -> String {
        let out = self.text[self.released..end].to_string();
        self.released = end;
        out
    }

    /// Bytes at the end of the text that begin some stop string (and so must wait).
    fn longest_partial_stop(&self) -> usize {
        let tail = &self.text[self.released..];
        self.stops
            .iter()
            .flat_map(|stop| {
                (1..stop.len().min(tail.len() + 1))
                    .rev()
                    .filter(|&n| stop.is_char_boundary(n) && tail.ends_with(&stop[..n]))
                    .take(1)
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut shown = Vec::new();
        let mut stopped = false;
        for piece in pieces {
            let (out, hit) = m.push(piece);
            shown.push(out);
            if hit {
                stopped = true;
                break;
            }
        }
        if !stopped {
            shown.push(m.finish());
        }
        (shown, stopped, m.text().to_string())
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_shown() {
        let (shown, stopped, text) = run(&["END"], &["abc E", "N", "D tail"]);
        assert_eq!(shown, vec!["abc ", "", ""]);
        assert!(stopped);
        assert_eq!(text, "abc ");
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching() {
        let (shown, stopped, text) = run(&["END"], &["x E", "Nx", "y"]);
        assert_eq!(shown, vec!["x ", "ENx", "y", ""]);
        assert!(!stopped);
        assert_eq!(text, "x ENxy");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_no_stops_streams_everything() {
        let (_, stopped, text) = run(&["b", "a"], &["xxab"]);
        assert!(stopped);
        assert_eq!(text, "xx");
        let (shown, stopped, _) = run(&[], &["a", "b"]);
        assert_eq!(shown, vec!["a", "b", ""]);
        assert!(!stopped);
    }
}
