package metrics

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// MaxLine is the longest line Parse accepts.
const MaxLine = 64 << 10

// Parse reads an exposition in the text format: families in the order
// they appear, a sample without a TYPE line before it in a family of its
// own, untyped. Timestamps are accepted and dropped. A family that
// appears twice, a malformed line or a line over MaxLine is an error
// naming the line; the caller bounds the input's total size.
func Parse(r io.Reader) ([]Family, error) {
	br := bufio.NewReaderSize(r, 4096)
	p := parser{seen: map[string]bool{}}
	for lineNo := 1; ; lineNo++ {
		line, err := readLine(br)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("metrics: line %d: %w", lineNo, err)
		}
		if err := p.line(line); err != nil {
			return nil, fmt.Errorf("metrics: line %d: %w", lineNo, err)
		}
	}
	return p.fams, nil
}

// readLine returns the next line without its line feed; io.EOF only when
// nothing is left.
func readLine(br *bufio.Reader) (string, error) {
	var b []byte
	for {
		chunk, err := br.ReadSlice('\n')
		b = append(b, chunk...)
		if len(b) > MaxLine+1 {
			return "", fmt.Errorf("line longer than %d bytes", MaxLine)
		}
		switch {
		case err == nil:
			return string(b[:len(b)-1]), nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case err == io.EOF && len(b) > 0:
			return string(b), nil
		default:
			return "", err
		}
	}
}

type parser struct {
	fams []Family
	seen map[string]bool // family names, to refuse a second appearance
}

// cur is the family being read, or nil.
func (p *parser) cur() *Family {
	if len(p.fams) == 0 {
		return nil
	}
	return &p.fams[len(p.fams)-1]
}

// family returns the family name for a HELP or TYPE line: the current one
// while it has no samples, else a new one.
func (p *parser) family(name string) (*Family, error) {
	if c := p.cur(); c != nil && c.Name == name && len(c.Samples) == 0 {
		return c, nil
	}
	if p.seen[name] {
		return nil, fmt.Errorf("family %s appears twice", name)
	}
	p.seen[name] = true
	p.fams = append(p.fams, Family{Name: name, Type: Untyped})
	return p.cur(), nil
}

func (p *parser) line(line string) error {
	s := strings.TrimLeft(line, " \t")
	if s == "" {
		return nil
	}
	if rest, ok := strings.CutPrefix(s, "#"); ok {
		return p.comment(rest)
	}
	return p.sample(s)
}

func (p *parser) comment(rest string) error {
	rest = strings.TrimLeft(rest, " \t")
	kw, rest := cutSpace(rest)
	if kw != "HELP" && kw != "TYPE" {
		return nil // a plain comment
	}
	name, rest := cutSpace(rest)
	if !ValidMetricName(name) {
		return fmt.Errorf("%s: invalid metric name %q", kw, name)
	}
	f, err := p.family(name)
	if err != nil {
		return err
	}
	if kw == "HELP" {
		if f.Help != "" {
			return fmt.Errorf("second HELP for %s", name)
		}
		f.Help, err = unescape(rest, false)
		return err
	}
	typ := Type(strings.TrimRight(rest, " \t"))
	switch typ {
	case Counter, Gauge, Histogram, Summary, Untyped:
	default:
		return fmt.Errorf("TYPE %s: unknown type %q", name, typ)
	}
	if f.Type != Untyped && f.Type != typ {
		return fmt.Errorf("second TYPE for %s", name)
	}
	f.Type = typ
	return nil
}

// cutSpace splits s at its first run of blanks.
func cutSpace(s string) (string, string) {
	i := strings.IndexAny(s, " \t")
	if i < 0 {
		return s, ""
	}
	return s[:i], strings.TrimLeft(s[i:], " \t")
}

func (p *parser) sample(s string) error {
	i := 0
	for i < len(s) && s[i] != '{' && s[i] != ' ' && s[i] != '\t' {
		i++
	}
	name := s[:i]
	if !ValidMetricName(name) {
		return fmt.Errorf("invalid metric name %q", name)
	}
	sm := Sample{Name: name}
	s = s[i:]
	if strings.HasPrefix(s, "{") {
		var err error
		if sm.Labels, s, err = parseLabels(s[1:]); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
	fields := strings.Fields(s)
	if len(fields) < 1 || len(fields) > 2 {
		return fmt.Errorf("%s: want a value and an optional timestamp, got %q", name, s)
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return fmt.Errorf("%s: value %q: %w", name, fields[0], err)
	}
	sm.Value = v
	if len(fields) == 2 {
		if _, err := strconv.ParseInt(fields[1], 10, 64); err != nil {
			return fmt.Errorf("%s: timestamp %q: %w", name, fields[1], err)
		}
	}
	c := p.cur()
	if c == nil || !belongs(c.Name, c.Type, name) {
		if c, err = p.family(name); err != nil {
			return err
		}
		if !belongs(c.Name, c.Type, name) {
			return fmt.Errorf("sample %s outside its family", name)
		}
	}
	c.Samples = append(c.Samples, sm)
	return nil
}

// parseLabels reads label pairs after the opening brace up to the closing
// one and returns what follows it.
func parseLabels(s string) ([]Label, string, error) {
	var labels []Label
	for {
		s = strings.TrimLeft(s, " \t")
		if rest, ok := strings.CutPrefix(s, "}"); ok {
			return labels, rest, nil
		}
		i := 0
		for i < len(s) && s[i] != '=' && s[i] != ' ' && s[i] != '\t' {
			i++
		}
		name := s[:i]
		if !ValidLabelName(name) {
			return nil, "", fmt.Errorf("invalid label name %q", name)
		}
		var ok bool
		s, ok = strings.CutPrefix(strings.TrimLeft(s[i:], " \t"), "=")
		if !ok {
			return nil, "", fmt.Errorf("label %s: want =", name)
		}
		s, ok = strings.CutPrefix(strings.TrimLeft(s, " \t"), `"`)
		if !ok {
			return nil, "", fmt.Errorf("label %s: want a quoted value", name)
		}
		end := -1
		for j := 0; j < len(s); j++ {
			if s[j] == '\\' {
				j++
				continue
			}
			if s[j] == '"' {
				end = j
				break
			}
		}
		if end < 0 {
			return nil, "", fmt.Errorf("label %s: unterminated value", name)
		}
		v, err := unescape(s[:end], true)
		if err != nil {
			return nil, "", fmt.Errorf("label %s: %w", name, err)
		}
		for _, l := range labels {
			if l.Name == name {
				return nil, "", fmt.Errorf("label %s twice", name)
			}
		}
		labels = append(labels, Label{Name: name, Value: v})
		s = strings.TrimLeft(s[end+1:], " \t")
		if rest, ok := strings.CutPrefix(s, ","); ok {
			s = rest
		} else if !strings.HasPrefix(s, "}") {
			return nil, "", fmt.Errorf("after label %s: want , or }", name)
		}
	}
}

// unescape undoes escapeHelp (quote false) or escapeLabelValue.
func unescape(s string, quote bool) (string, error) {
	if !strings.Contains(s, `\`) {
		return s, nil
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' {
			b.WriteByte(c)
			continue
		}
		i++
		if i == len(s) {
			return "", errors.New("trailing backslash")
		}
		switch s[i] {
		case '\\':
			b.WriteByte('\\')
		case 'n':
			b.WriteByte('\n')
		case '"':
			if !quote {
				// HELP keeps other escapes as written.
				b.WriteString(`\"`)
				continue
			}
			b.WriteByte('"')
		default:
			if quote {
				return "", fmt.Errorf("invalid escape \\%c", s[i])
			}
			b.WriteByte('\\')
			b.WriteByte(s[i])
		}
	}
	return b.String(), nil
}
